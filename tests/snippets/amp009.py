"""AMP009 deprecated-amp-api: torch.cuda.amp / torch.cpu.amp spellings of the torch.amp API."""
import functools

import torch
import torch.cuda.amp
import torch.cuda.amp as cuda_amp
import torch_npu
from packaging import version
from torch.cuda import amp
from torch.cuda.amp import GradScaler, autocast
from torch.cuda.amp import custom_bwd as old_custom_bwd
from torch.cuda.amp import custom_fwd
from torch.cpu.amp import autocast as cpu_autocast

if torch.__version__ >= "2.4":
    gated_scaler = torch.amp.GradScaler("cuda")
else:
    gated_scaler = torch.cuda.amp.GradScaler()


# ---------------------------------------------------------------- positives


def old_scaler():
    return torch.cuda.amp.GradScaler()  # AMP009


def old_autocast(model, batch):
    with torch.cuda.amp.autocast():  # AMP009
        return model(batch)


def old_autocast_with_dtype(model, batch):
    with torch.cuda.amp.autocast(dtype=torch.bfloat16):  # AMP009
        return model(batch)


def old_cpu_autocast(model, batch):
    with torch.cpu.amp.autocast():  # AMP009
        return model(batch)


def module_alias_scaler(enabled):
    return amp.GradScaler(enabled=enabled)  # AMP009


def module_alias_autocast(model, batch):
    with amp.autocast(enabled=True):  # AMP009
        return model(batch)


def imported_names(model, batch):
    scaler = GradScaler()  # AMP009
    with autocast():  # AMP009
        loss = model(batch)
    return scaler, loss


@torch.cuda.amp.autocast()  # AMP009
def decorated_forward(model, batch):
    return model(batch)


class MyFunction(torch.autograd.Function):
    @staticmethod
    @custom_fwd  # AMP009
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @old_custom_bwd  # AMP009
    def backward(ctx, grad):
        return grad * 2


class OtherFunction(torch.autograd.Function):
    @staticmethod
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)  # AMP009
    def forward(ctx, x):
        return x

    @staticmethod
    @torch.cuda.amp.custom_bwd  # AMP009
    def backward(ctx, grad):
        return grad


def stored_reference():
    factory = torch.cuda.amp.GradScaler  # AMP009
    return factory(init_scale=1024)


def in_training_loop(model, loader, optimizer):
    scaler = torch.cuda.amp.GradScaler(enabled=True)  # AMP009
    for batch in loader:
        with torch.autocast("cuda"):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def old_versions_rejected_first():
    if not hasattr(torch.cuda, "amp"):
        raise RuntimeError("mixed precision needs torch >= 1.6")
    return torch.cuda.amp.GradScaler()  # AMP009


def enabled_by_dtype(dtype):
    return torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))  # AMP009


def scaler_with_options():
    return torch.cuda.amp.GradScaler(init_scale=2.0**16, growth_interval=2000)  # AMP009


def module_imported_as(model, batch):
    with cuda_amp.autocast():  # AMP009
        return model(batch)


def renamed_cpu_autocast(model, batch):
    with cpu_autocast(dtype=torch.bfloat16):  # AMP009
        return model(batch)


class Config:
    scaler_class = torch.cuda.amp.GradScaler  # AMP009


def get_autocast(precision):
    if precision == "amp":
        return torch.cuda.amp.autocast  # AMP009
    return None


def conditional_alias(use_amp):
    return torch.cuda.amp.autocast if use_amp else None  # AMP009


def partial_target():
    return functools.partial(torch.cuda.amp.autocast, dtype=torch.float16)  # AMP009


# ---------------------------------------------------------------- negatives


def modern_scaler():
    return torch.amp.GradScaler("cuda")


def modern_autocast(model, batch):
    with torch.amp.autocast("cuda", dtype=torch.float16):
        return model(batch)


def generic_autocast(model, batch):
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        return model(batch)


def try_modern_first():
    try:
        return torch.amp.GradScaler("cuda")
    except (AttributeError, TypeError):
        return torch.cuda.amp.GradScaler()


def try_import_modern_first():
    try:
        from torch.amp import GradScaler as Scaler
    except ImportError:
        from torch.cuda.amp import GradScaler as Scaler
    return Scaler()


def version_flag(model, batch, TORCH_GE_2_4):
    if TORCH_GE_2_4:
        ctx = torch.amp.autocast("cuda")
    else:
        ctx = torch.cuda.amp.autocast()
    with ctx:
        return model(batch)


def hasattr_gate():
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda")
    return torch.cuda.amp.GradScaler()


def conditional_expression_gate(version):
    return torch.amp.GradScaler("cuda") if version >= (2, 4) else torch.cuda.amp.GradScaler()


def vendor_namespace(model, batch):
    with torch.npu.amp.autocast():
        loss = model(batch)
    return torch_npu.npu.amp.GradScaler(), loss


def xpu_namespace(model, batch):
    with torch.xpu.amp.autocast():
        return model(batch)


def in_docstring():
    """Replaces torch.cuda.amp.GradScaler() with torch.amp.GradScaler("cuda")."""
    return torch.amp.GradScaler("cuda")


def in_string():
    message = "torch.cuda.amp.autocast is deprecated"
    return message


def module_level_gate():
    return gated_scaler


def modern_custom_fwd():
    return torch.amp.custom_fwd(device_type="cuda")


def other_cuda_apis():
    torch.cuda.synchronize()
    return torch.cuda.is_bf16_supported()


def isinstance_check_is_not_a_use(obj):
    return isinstance(obj, torch.cuda.amp.GradScaler)


def recognising_both_apis(func):
    return func in (torch.amp.autocast, torch.cuda.amp.autocast, torch.cpu.amp.autocast)


def apex_amp_is_not_torch(model, optimizer):
    from apex import amp as apex_amp

    return apex_amp.initialize(model, optimizer, opt_level="O1")


# ---- defaults, keyword arguments, and if/else on the amp switch ---------------------


def train_with_default_scaler(model, loader, scaler=torch.cuda.amp.GradScaler()):  # AMP009
    for batch in loader:
        scaler.scale(model(batch)).backward()


class EngineWithContextDefault:
    def __init__(self, model, amp_ctx=torch.cuda.amp.autocast):  # AMP009
        self.model = model
        self.amp_ctx = amp_ctx


def build_engine_with_keyword(model, Engine):
    return Engine(model, grad_scaler=torch.cuda.amp.GradScaler(init_scale=1024))  # AMP009


def context_for_amp_switch(amp):
    return torch.cuda.amp.autocast() if amp else torch.autocast("cuda", enabled=False)  # AMP009


def train_with_modern_default(model, loader, scaler=torch.amp.GradScaler("cuda")):
    for batch in loader:
        scaler.scale(model(batch)).backward()


def scaler_for_torch_version(new_api):
    return torch.amp.GradScaler("cuda") if new_api else torch.cuda.amp.GradScaler()


def speechbrain_scaler(device, enabled):
    if version.parse(torch.__version__) < version.parse("2.4.0"):
        return torch.cuda.amp.GradScaler(enabled=enabled)
    else:
        return torch.GradScaler(device, enabled=enabled)  # the top-level alias of torch.amp's


def checks_either_scaler_class(obj):
    return isinstance(obj, (torch.amp.GradScaler, torch.cuda.amp.GradScaler))


# ---- a version test that offers no torch.amp chooses nothing (mmcv, mmengine) ------------
def mmcv_autocast_after_version_check(model, batch, TORCH_VERSION, digit_version):
    if digit_version(TORCH_VERSION) >= digit_version("1.6.0"):
        with torch.cuda.amp.autocast(enabled=True):  # AMP009
            return model(batch)
    return model(batch)


def mmengine_scaler_type(use_fsdp, ShardedGradScaler, digit_version):
    if use_fsdp:
        if digit_version(torch.__version__) >= digit_version("2.0.0"):
            scaler_type = ShardedGradScaler
        else:
            raise RuntimeError("PyTorch>=2.0.0 is required for use_fsdp=True")
    elif digit_version(torch.__version__) >= digit_version("1.6.0"):
        scaler_type = GradScaler  # AMP009
    else:
        raise RuntimeError("mixed precision needs torch >= 1.6")
    return scaler_type()


def version_test_offering_torch_amp(model, batch, digit_version):
    if digit_version(torch.__version__) < digit_version("2.4.0"):
        ctx = torch.cuda.amp.autocast()
    else:
        ctx = torch.autocast("cuda")
    with ctx:
        return model(batch)


# ---- a vendor dispatch of imports: the deprecated API is what CUDA gets ------------------
def vendor_dispatch_scaler(is_npu_available):
    if is_npu_available():
        from torch.npu.amp import GradScaler as DispatchScaler
    else:
        from torch.cuda.amp import GradScaler as DispatchScaler
    return DispatchScaler()  # AMP009


def vendor_dispatch_to_torch_amp(is_npu_available):
    if is_npu_available():
        from torch.npu.amp import GradScaler as DispatchScaler
    else:
        from torch.amp import GradScaler as DispatchScaler
    return DispatchScaler("cuda")


# ---- a device test picks no API: the old spelling is what that device runs today -------
def preview_autocast(device):
    if device.type == "cuda":
        ctx = torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        ctx = torch.cpu.amp.autocast(dtype=torch.bfloat16)  # AMP009
    return ctx


def scaler_for_device():
    return torch.cuda.amp.GradScaler() if torch.cuda.is_available() else torch.amp.GradScaler("cpu")  # AMP009


def autocast_for_device_and_version(device):
    if hasattr(torch, "amp") and device.type == "cuda":
        return torch.autocast("cuda")
    else:
        return torch.cuda.amp.autocast()
