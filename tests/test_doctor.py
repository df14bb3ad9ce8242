"""amp_runtime.doctor: this machine probed for real; advice checked for known GPUs."""
import json

import torch

from amp_runtime.doctor import (
    Capabilities, CudaDevice, DoctorResult, diagnose, probe, recommend,
)


def _caps(devices=(), bf16_native=False, tf32=False):
    return Capabilities(
        torch_version="2.4.0", cuda_version="12.1" if devices else None,
        cuda_devices=tuple(devices),
        cpu_capability="AVX512", cpu_bf16_native=bf16_native, cpu_fp16_native=False,
        cpu_autocast_dtypes=("bfloat16", "float16"), tf32_matmul=tf32, tf32_cudnn=True,
    )


def test_probe_reads_this_machine():
    caps = probe()
    assert caps.torch_version == torch.__version__
    assert len(caps.cuda_devices) == torch.cuda.device_count()
    assert caps.cpu_capability == torch.backends.cpu.get_cpu_capability()
    # CPU autocast in torch >= 2.3 produces bf16 (and fp16) matmuls
    assert "bfloat16" in caps.cpu_autocast_dtypes


def test_diagnose_prints_capabilities_and_advice():
    result = diagnose()
    text = str(result)
    assert f"torch {torch.__version__}" in text and "CPU autocast dtypes:" in text
    assert "Recommended on" in text
    data = json.loads(json.dumps(result.to_json()))
    assert data["recommendations"] and data["capabilities"]["cpu_capability"]


def test_ampere_gets_bf16_without_scaler_and_tf32():
    a100 = CudaDevice(0, "NVIDIA A100-SXM4-40GB", (8, 0), 40.0)
    (rec,) = recommend(_caps([a100]))
    assert rec.dtype == "bfloat16" and rec.scaler is None
    assert any("allow_tf32 = True" in line for line in rec.code)
    assert any("no GradScaler" in r for r in rec.reasons)
    (already,) = recommend(_caps([a100], tf32=True))
    assert not any("allow_tf32" in line for line in already.code)


def test_volta_and_turing_get_fp16_with_scaler():
    for dev in (CudaDevice(0, "Tesla V100", (7, 0), 16.0), CudaDevice(1, "Tesla T4", (7, 5), 15.0)):
        (rec,) = recommend(_caps([dev]))
        assert rec.dtype == "float16"
        assert 'GradScaler("cuda")' in rec.scaler
        assert any("tensor cores" in r for r in rec.reasons)


def test_consumer_pascal_stays_fp32_and_each_device_gets_advice():
    gtx = CudaDevice(0, "GeForce GTX 1080", (6, 1), 8.0)
    p100 = CudaDevice(1, "Tesla P100", (6, 0), 16.0)
    recs = recommend(_caps([gtx, p100]))
    assert [r.dtype for r in recs] == ["float32", "float16"]
    assert recs[0].device.startswith("cuda:0") and recs[1].device.startswith("cuda:1")


def test_cpu_advice_depends_on_native_bf16():
    (native,) = recommend(_caps(bf16_native=True))
    assert native.dtype == "bfloat16" and native.scaler is None
    assert native.code == ['with torch.autocast("cpu", dtype=torch.bfloat16):']
    (emulated,) = recommend(_caps(bf16_native=False))
    assert emulated.dtype == "float32"
    assert any("memory" in r for r in emulated.reasons)


def test_cpu_only_output_has_no_tf32_and_says_why_not_float16():
    (native,) = recommend(_caps(bf16_native=True))
    assert any("float16 CPU autocast also runs" in r and "emulated" in r for r in native.reasons)
    shown = str(DoctorResult(_caps(bf16_native=True), [native]))
    assert "TF32" not in shown  # a CUDA switch: meaningless on a CPU-only machine
    assert '  Code:\n    with torch.autocast("cpu", dtype=torch.bfloat16):' in shown
