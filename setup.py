"""Build for kvoffload.

The CUDA extension `kernels._C` is built with nvcc when nvcc is found (PATH,
$CUDA_HOME/bin or /usr/local/cuda/bin). It links only the CUDA runtime
(statically), never libtorch. Without nvcc the install still succeeds and the
Triton and torch paths work; `python -m kernels` says why `cuda`/`dma` are off.

Environment:
  KVO_CUDA_ARCHS   semicolon list of SM versions, default "80;90" (sm_90 also
                   embeds PTX so newer GPUs can JIT it).
  KVO_NO_CUDA=1    skip the extension even if nvcc exists.
"""
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def find_nvcc():
    if os.environ.get("KVO_NO_CUDA") == "1":
        return None
    cands = [shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            cands.append(os.path.join(root, "bin", "nvcc"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


class NvccBuildExt(build_ext):
    """Compiles each .cu source with nvcc and links the objects into the module."""

    def build_extension(self, ext):
        nvcc = find_nvcc()
        cuda_home = os.path.dirname(os.path.dirname(nvcc))
        import pybind11

        archs = os.environ.get("KVO_CUDA_ARCHS", "80;90").split(";")
        gencode = []
        for a in archs:
            gencode += [f"-gencode=arch=compute_{a},code=sm_{a}"]
        top = max(archs, key=int)
        gencode += [f"-gencode=arch=compute_{top},code=compute_{top}"]  # PTX for newer GPUs
        build_temp = os.path.abspath(self.build_temp)
        os.makedirs(build_temp, exist_ok=True)
        includes = [pybind11.get_include(), sysconfig.get_paths()["include"],
                    os.path.join(HERE, "kernels", "csrc")]
        objects = []
        for src in ext.sources:
            obj = os.path.join(build_temp, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                   "-Xcompiler", "-fvisibility=hidden", "--expt-relaxed-constexpr",
                   "-lineinfo", *gencode] + [f"-I{i}" for i in includes]
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd)
            objects.append(obj)
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        libdirs = [os.path.join(cuda_home, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
        cmd = [nvcc, "-shared", "-o", out, *objects, *gencode, "-cudart=static"]
        cmd += [f"-L{d}" for d in libdirs if os.path.isdir(d)]
        print(" ".join(cmd), flush=True)
        subprocess.check_call(cmd)


ext_modules = []
if find_nvcc():
    ext_modules.append(Extension("kernels._C", sources=["kernels/csrc/bindings.cu"]))
else:
    print("kvoffload: nvcc not found; building without kernels._C (Triton/torch paths only)",
          file=sys.stderr)

setup(ext_modules=ext_modules, cmdclass={"build_ext": NvccBuildExt})
