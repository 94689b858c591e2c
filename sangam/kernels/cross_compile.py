"""Compile the kernels for a GPU that is not here (an H200 by default) and report their resources.

Inside :func:`cross_compiling`, every kernel launch a wrapper makes runs Triton's whole pipeline
for the target (Triton IR, LLVM, PTX, then ``ptxas`` to a cubin) and is recorded instead of
run: registers per thread, bytes spilled to local memory, and shared memory per program.
Wrappers size their launches for that GPU (``platform.assume_gpu``), so what compiles is what a
GPU would launch. Inputs may be meta tensors: nothing is read or written.

This catches what the CPU interpreter cannot: code generation failures, shared memory over the
chip's limit, and register spills. It needs compiled kernels (``TRITON_INTERPRET`` unset when
Triton is first imported) and the ``ptxas``/``cuobjdump`` that ship with Triton; no GPU and no
CUDA driver. Timings still need the GPU. Run it in a process that launches no kernels of its
own (``sangam-bench kernels`` and the tests use a subprocess): Triton's JIT remembers the
target it saw per device.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.compiler import ASTSource

from sangam.kernels.platform import assume_gpu, interpreting


@dataclass(frozen=True)
class CompileTarget:
    """What a cross-compile targets: the compute capability and the limits a launch must fit."""

    name: str
    arch: int  # compute capability as an integer, e.g. 90 for sm_90
    sms: int
    max_shared_bytes: int  # per program (thread block), opt-in maximum


H200 = CompileTarget("H200", arch=90, sms=132, max_shared_bytes=227 * 1024)
TARGETS = {spec.name: spec for spec in (
    H200,
    CompileTarget("H100", arch=90, sms=132, max_shared_bytes=227 * 1024),
    CompileTarget("A100", arch=80, sms=108, max_shared_bytes=163 * 1024),
)}


@dataclass(frozen=True)
class KernelBuild:
    """One compiled launch configuration of a kernel."""

    kernel: str
    constants: dict[str, object]  # the constexpr arguments, by name
    num_warps: int
    num_stages: int
    registers: int  # per thread
    spill_bytes: int  # per thread: ptxas stack frame + local memory
    shared_bytes: int  # per program
    # Global-memory load instructions in the PTX: 16-byte ones (ld.global.v4 of 32-bit words,
    # cp.async of 16 bytes), and all others. Memory-bound kernels want the first kind.
    wide_loads: int
    narrow_loads: int
    mma: str  # tensor-core instructions: "wgmma" (Hopper, async), "mma.sync", or "none"

    def describe(self) -> str:
        consts = " ".join(f"{k}={_short(v)}" for k, v in self.constants.items())
        return (f"{self.kernel}[{consts} warps={self.num_warps} stages={self.num_stages}]: "
                f"{self.registers} regs, {self.spill_bytes} B spilled, "
                f"{self.shared_bytes / 1024:.1f} KiB shared, "
                f"{self.wide_loads} 16-byte / {self.narrow_loads} narrower global loads"
                + ("" if self.mma == "none" else f", {self.mma}"))


def _short(value: object) -> str:
    return str(value).removeprefix("triton.language.")


class _OfflineDriver(DriverBase):
    """Just enough of a CUDA driver for the JIT to pick a target; launches never reach it."""

    def __init__(self, arch: int):
        super().__init__()
        self.target = GPUTarget("cuda", arch, 32)

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("offline driver: nothing is launched")

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("offline driver: nothing is timed")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


_RESOURCE_LINE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, spilled bytes) of the one function in a cubin, from ``cuobjdump``."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    match = _RESOURCE_LINE.search(out)
    if match is None:
        raise RuntimeError(f"cannot read the resource usage from cuobjdump:\n{out}")
    regs, stack, local = map(int, match.groups())
    return regs, stack + local


_WIDE_LOAD = re.compile(r"^\s*(?:@%p\d+\s+)?(?:ld\.global(?:\.\w+)*\.v4\.(?:b|u|s|f)32|"
                        r"cp\.async\.c[ga]\.shared\.global\s[^,]*,[^,]*,\s*(?:16|0x10)\b)",
                        re.MULTILINE)
_ANY_LOAD = re.compile(r"^\s*(?:@%p\d+\s+)?(?:ld\.global|cp\.async\.c[ga]\.shared\.global)",
                       re.MULTILINE)


def _ptx_facts(ptx: str) -> tuple[int, int, str]:
    """(16-byte, narrower) global load instructions in ``ptx``, and its tensor-core kind."""
    wide = len(_WIDE_LOAD.findall(ptx))
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    return wide, len(_ANY_LOAD.findall(ptx)) - wide, mma


@contextmanager
def cross_compiling(target: CompileTarget = H200) -> Iterator[list[KernelBuild]]:
    """Within the block, kernel launches compile for ``target`` instead of running; yields the list
    of distinct builds, filled as launches happen. A launch that fails to compile raises."""
    if interpreting():
        raise RuntimeError("cross-compiling needs compiled kernels: run without TRITON_INTERPRET")
    triton_target = GPUTarget("cuda", target.arch, 32)
    builds: list[KernelBuild] = []
    seen: set = set()

    def compile_instead_of_launching(*, key, fn, compile, **_) -> bool:
        if key not in seen:
            seen.add(key)
            jit = fn.jit_function
            options = {name: compile[name] for name in
                       ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")}
            kernel = triton.compile(
                ASTSource(jit, compile["signature"], compile["constants"], compile["configs"][0]),
                target=triton_target, options=options)
            regs, spilled = _resources(kernel.asm["cubin"])
            # The declared constexprs only (Triton also folds integer arguments equal to 1).
            consts = {jit.params[path[0]].name: value
                      for path, value in compile["constants"].items()
                      if len(path) == 1 and jit.params[path[0]].is_constexpr}
            builds.append(KernelBuild(jit.__name__, consts, options["num_warps"],
                                      options["num_stages"], regs, spilled,
                                      kernel.metadata.shared, *_ptx_facts(kernel.asm["ptx"])))
        return True  # handled: the JIT neither compiles nor launches

    runtime, drivers = triton.knobs.runtime, triton.runtime.driver
    # Restored as found: reset_active() would look for a real driver, and there may be none.
    previous_hook, previous_driver = runtime.jit_cache_hook, drivers._active
    drivers.set_active(_OfflineDriver(target.arch))
    runtime.jit_cache_hook = compile_instead_of_launching
    try:
        with assume_gpu(target.sms, target.max_shared_bytes):
            yield builds
    finally:
        runtime.jit_cache_hook = previous_hook
        drivers._active = previous_driver
