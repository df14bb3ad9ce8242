"""What this machine supports for mixed precision, and what to use.

``probe()`` reads the hardware through torch (CUDA devices and their compute
capability, the CPU's vector extensions, which dtypes CPU autocast accepts);
``recommend(capabilities)`` is a pure function of that data, so the advice for any
GPU can be checked without owning one; ``diagnose()`` does both.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

#: GradScaler's defaults, spelled out so the advice shows what they are.
_SCALER_DEFAULTS = "init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000"


@dataclass(frozen=True)
class CudaDevice:
    index: int
    name: str
    capability: Tuple[int, int]
    memory_gib: float

    @property
    def tensor_cores(self) -> bool:
        return self.capability >= (7, 0)

    @property
    def bf16(self) -> bool:
        """Native bfloat16 math (Ampere and newer)."""
        return self.capability >= (8, 0)

    @property
    def tf32(self) -> bool:
        return self.capability >= (8, 0)

    @property
    def fast_fp16(self) -> bool:
        """float16 faster than float32: tensor cores, or sm_60/sm_62's double-rate fp16."""
        return self.tensor_cores or self.capability in ((6, 0), (6, 2))

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data.update(tensor_cores=self.tensor_cores, bf16=self.bf16, tf32=self.tf32,
                    fast_fp16=self.fast_fp16)
        return data


@dataclass(frozen=True)
class Capabilities:
    torch_version: str
    cuda_version: Optional[str]
    cuda_devices: Tuple[CudaDevice, ...]
    #: The vector extension torch's CPU kernels use ("AVX2", "AVX512", ...).
    cpu_capability: str
    #: Native bfloat16 dot products (AVX512-BF16 or AMX).
    cpu_bf16_native: bool
    #: Native float16 dot products (AMX-FP16).
    cpu_fp16_native: bool
    #: dtypes ``torch.autocast("cpu", dtype=...)`` actually produces on this build.
    cpu_autocast_dtypes: Tuple[str, ...]
    #: The current TF32 switches (they matter for the float32 ops autocast leaves).
    tf32_matmul: bool
    tf32_cudnn: bool
    mps: bool = False

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data["cuda_devices"] = [d.to_json() for d in self.cuda_devices]
        return data


@dataclass
class Recommendation:
    device: str
    #: "bfloat16", "float16" or "float32" (no autocast).
    dtype: str
    #: The GradScaler line to use, or None when none is needed.
    scaler: Optional[str]
    #: Code to paste: the autocast context and any backend switches.
    code: List[str]
    reasons: List[str]


@dataclass
class DoctorResult:
    capabilities: Capabilities
    recommendations: List[Recommendation] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {
            "capabilities": self.capabilities.to_json(),
            "recommendations": [asdict(r) for r in self.recommendations],
        }

    def __str__(self) -> str:
        caps = self.capabilities
        lines = [f"torch {caps.torch_version}, CUDA {caps.cuda_version or 'not built in'}"]
        if not caps.cuda_devices:
            lines.append("CUDA devices: none")
        for dev in caps.cuda_devices:
            features = (("tensor cores", dev.tensor_cores), ("fast fp16", dev.fast_fp16),
                        ("bf16", dev.bf16), ("tf32", dev.tf32))
            feats = [f"{name} {_yes(ok)}" for name, ok in features]
            lines.append(
                f"cuda:{dev.index}  {dev.name}  sm_{dev.capability[0]}{dev.capability[1]}  "
                f"{dev.memory_gib:.0f} GiB  " + ", ".join(feats))
        lines.append(
            f"CPU: {caps.cpu_capability}, native bf16 {_yes(caps.cpu_bf16_native)}, "
            f"native fp16 {_yes(caps.cpu_fp16_native)}, "
            f"CPU autocast dtypes: {', '.join(caps.cpu_autocast_dtypes) or 'none'}")
        if caps.cuda_devices:  # TF32 is a CUDA feature: its switches mean nothing without one
            lines.append(f"TF32: matmul {_on(caps.tf32_matmul)}, cuDNN {_on(caps.tf32_cudnn)}")
        if caps.mps:
            lines.append("Apple MPS: available")
        for rec in self.recommendations:
            scaler = "with GradScaler" if rec.scaler else "no GradScaler"
            advice = "no autocast" if rec.dtype == "float32" else f"{rec.dtype} autocast, {scaler}"
            lines += ["", f"Recommended on {rec.device}: {advice}"]
            lines += [f"  - {reason}" for reason in rec.reasons]
            if rec.code:
                lines += ["  Code:", *(f"    {line}" for line in rec.code)]
        return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def probe() -> Capabilities:
    """Read this machine's capabilities through torch."""
    import torch

    devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            capability = (props.major, props.minor)
            devices.append(CudaDevice(index, props.name, capability, props.total_memory / 2**30))
    cpu = torch.cpu
    return Capabilities(
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        cuda_devices=tuple(devices),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu_bf16_native=bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()),
        cpu_fp16_native=bool(cpu._is_amx_fp16_supported()),
        cpu_autocast_dtypes=tuple(_cpu_autocast_dtypes(torch)),
        tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
        tf32_cudnn=bool(torch.backends.cudnn.allow_tf32),
        mps=bool(torch.backends.mps.is_available()),
    )


def _cpu_autocast_dtypes(torch) -> List[str]:
    """The low-precision dtypes a matmul under CPU autocast really runs in."""
    supported = []
    a = torch.ones(2, 2)
    for dtype in (torch.bfloat16, torch.float16):
        try:
            with torch.autocast("cpu", dtype=dtype):
                produced = (a @ a).dtype
        except (RuntimeError, ValueError):
            continue
        if produced == dtype:
            supported.append(str(dtype).replace("torch.", ""))
    return supported


def recommend(caps: Capabilities) -> List[Recommendation]:
    """Autocast dtype and GradScaler advice for each CUDA device, or for the CPU."""
    if caps.cuda_devices:
        return [_recommend_cuda(dev, caps) for dev in caps.cuda_devices]
    return [_recommend_cpu(caps)]


def _recommend_cuda(dev: CudaDevice, caps: Capabilities) -> Recommendation:
    device = f"cuda:{dev.index} ({dev.name})"
    if dev.bf16:
        tf32 = [] if caps.tf32_matmul else [
            "torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for the fp32 ops"]
        return Recommendation(
            device, "bfloat16", None,
            ['with torch.autocast("cuda", dtype=torch.bfloat16):', *tf32],
            [
                f"sm_{dev.capability[0]}{dev.capability[1]} has native bfloat16 tensor cores.",
                "bfloat16 has float32's exponent range: no overflow, no underflow of small "
                "gradients, so no GradScaler (and no skipped steps).",
                "Its 8-bit mantissa is coarser than float16's; check sensitive modules with "
                "amp_runtime.compare(model, batch, dtype=torch.bfloat16).",
                *(["TF32 is off: turning it on speeds up the matmuls autocast keeps in float32."]
                  if tf32 else ["TF32 is already on for matmuls."]),
            ],
        )
    if dev.fast_fp16:
        why = ("has tensor cores for float16 (keep matmul dimensions multiples of 8 to use them)"
               if dev.tensor_cores else "runs float16 at twice the float32 rate (no tensor cores)")
        return Recommendation(
            device, "float16", f'scaler = torch.amp.GradScaler("cuda")  # {_SCALER_DEFAULTS}',
            ['with torch.autocast("cuda", dtype=torch.float16):',
             'scaler = torch.amp.GradScaler("cuda")'],
            [
                f"sm_{dev.capability[0]}{dev.capability[1]} {why}.",
                "It has no native bfloat16 (emulated, slow) and no TF32.",
                "float16 overflows above 65504 and flushes gradients below 6e-8 to zero: "
                "a GradScaler is required; its defaults suit most models.",
            ],
        )
    return Recommendation(
        device, "float32", None, [],
        [
            f"sm_{dev.capability[0]}{dev.capability[1]} computes float16 no faster than float32 "
            "and has no bfloat16: autocast would add casts for no speed.",
            "Use float16 autocast with GradScaler only if activation memory is the limit.",
        ],
    )


def _recommend_cpu(caps: Capabilities) -> Recommendation:
    if "bfloat16" not in caps.cpu_autocast_dtypes:
        return Recommendation("cpu", "float32", None, [],
                              ["CPU autocast does not produce bfloat16 on this build."])
    code = ['with torch.autocast("cpu", dtype=torch.bfloat16):']
    no_scaler = "bfloat16 has float32's exponent range, so no GradScaler is needed."
    if caps.cpu_bf16_native:
        return Recommendation("cpu", "bfloat16", None, code, [
            "This CPU has native bfloat16 dot products (AVX512-BF16 or AMX): bfloat16 "
            "matmuls are faster than float32.",
            no_scaler,
            *([_cpu_fp16_reason(caps)] if "float16" in caps.cpu_autocast_dtypes else []),
        ])
    return Recommendation("cpu", "float32", None, [], [
        f"This CPU ({caps.cpu_capability}) has no native bfloat16 or float16 math: low precision "
        "is emulated, usually slower than float32.",
        "bfloat16 CPU autocast still works and halves activation memory: "
        'use torch.autocast("cpu", dtype=torch.bfloat16) if memory is the limit. ' + no_scaler,
        "float16 on CPU needs torch.amp.GradScaler(\"cpu\") and gains nothing here.",
    ])


def _cpu_fp16_reason(caps: Capabilities) -> str:
    """Why not float16, which CPU autocast also accepts."""
    if caps.cpu_fp16_native:
        return ("float16 is native too (AMX-FP16), but it needs torch.amp.GradScaler(\"cpu\") "
                "against overflow and underflow; bfloat16 does not.")
    return ("float16 CPU autocast also runs, but this CPU has no native float16 math "
            "(AMX-FP16): it is emulated, far slower than float32, and needs a GradScaler.")


def diagnose() -> DoctorResult:
    caps = probe()
    return DoctorResult(caps, recommend(caps))
