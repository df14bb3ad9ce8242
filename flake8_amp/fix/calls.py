"""Argument-list surgery on libcst calls that keeps the call's own layout.

A new argument takes the separator of its neighbours: ``f(a, b)`` gets ``, `` and a call
written one argument per line gets a new line at the same indentation.
"""

from __future__ import annotations

from typing import List

import libcst as cst

NO_SPACE = cst.SimpleWhitespace("")


def keyword(name: str, value: cst.BaseExpression) -> cst.Arg:
    """``name=value`` written as PEP 8 writes keyword arguments (no spaces around ``=``)."""
    return cst.Arg(
        keyword=cst.Name(name),
        value=value,
        equal=cst.AssignEqual(whitespace_before=NO_SPACE, whitespace_after=NO_SPACE),
    )


def as_keyword(arg: cst.Arg, name: str) -> cst.Arg:
    """The positional argument ``arg`` passed as ``name=`` instead, comments kept."""
    return arg.with_changes(
        keyword=cst.Name(name),
        equal=cst.AssignEqual(whitespace_before=NO_SPACE, whitespace_after=NO_SPACE),
    )


def insert_argument(call: cst.Call, index: int, arg: cst.Arg) -> cst.Call:
    """``call`` with ``arg`` inserted at ``index`` of its argument list."""
    args: List[cst.Arg] = list(call.args)
    if index < len(args):
        before = call.whitespace_before_args if index == 0 else _comma_after(args[index - 1])
        args.insert(index, arg.with_changes(comma=cst.Comma(whitespace_after=_separator(before))))
    elif args:
        last = args[-1]
        if isinstance(last.comma, cst.Comma):  # a trailing comma: keep it last
            args[-1] = last.with_changes(
                comma=cst.Comma(whitespace_after=_separator(call.whitespace_before_args))
            )
            args.append(arg.with_changes(comma=last.comma))
        else:
            space = cst.SimpleWhitespace(" ")
            args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=space))
            args.append(arg)
    else:
        args.append(arg)
    return call.with_changes(args=args)


def _comma_after(arg: cst.Arg) -> cst.BaseParenthesizableWhitespace:
    return arg.comma.whitespace_after if isinstance(arg.comma, cst.Comma) else NO_SPACE


def _separator(
    whitespace: cst.BaseParenthesizableWhitespace,
) -> cst.BaseParenthesizableWhitespace:
    """The whitespace to put after a new comma: the same line break and indentation where
    the arguments are one per line, else one space."""
    if isinstance(whitespace, cst.ParenthesizedWhitespace):
        return whitespace
    return cst.SimpleWhitespace(" ")
