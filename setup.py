"""Builds the native kernels (tandem_native): each ISA variant compiled with only its own flags; and,
where grpc++ is installed, the inline gRPC stream's client and server (tandem_grpc)."""

import os
import shutil
import subprocess
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

NATIVE = Path("native")
COMMON_FLAGS = ["-std=c++17", "-O3", "-fvisibility=hidden", "-pthread"]
# variant folder -> its instruction-set flags; generic code gets none beyond the x86-64 baseline.
# Ordered from the smallest instruction set up, each a superset of the ones before: the objects are
# linked in this order, after the baseline ones, so an inline function that several of them emit
# (a std::vector member, say) is kept in the copy built for the smallest set.
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
VARIANTS = {
    "generic": [],
    "avx2": AVX2,
    "avx512": AVX512,
    "avx512_vnni": AVX512 + ["-mavx512vnni"],
    "avx512_bf16": AVX512 + ["-mavx512vnni", "-mavx512bf16"],
    "amx": AVX512 + ["-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
}


class BuildVariants(build_ext):
    """Compiles each native/src/<variant>/*.cpp with that variant's flags, then links them in."""

    def build_extension(self, ext):
        if ext.name != "tandem_native":
            return super().build_extension(ext)
        objects = []
        for variant, flags in VARIANTS.items():
            sources = sorted(str(p) for p in (NATIVE / "src" / variant).glob("*.cpp"))
            objects += self.compiler.compile(
                sources, output_dir=self.build_temp, include_dirs=[str(NATIVE / "include"), str(NATIVE / "src")],
                extra_postargs=COMMON_FLAGS + flags,
            )
        ext.extra_objects = objects
        super().build_extension(ext)


ext = Pybind11Extension(
    "tandem_native",
    sorted(str(p) for p in (NATIVE / "src").glob("*.cpp")),
    # every native file: a change to any of them (a variant's source, a header) rebuilds the module
    depends=sorted(str(p) for p in NATIVE.rglob("*") if p.suffix in (".cpp", ".h")),
    include_dirs=[str(NATIVE / "include"), str(NATIVE / "src")],
    extra_compile_args=COMMON_FLAGS,
    extra_link_args=["-pthread"],
    cxx_std=17,
)



def pkg_config(*args: str) -> list[str]:
    return subprocess.run(["pkg-config", *args, "grpc++", "protobuf"], check=True, capture_output=True,
                          text=True).stdout.split()


def grpc_extension():
    """tandem_grpc from native/grpc and the C++ code protoc generates for the expert service; None
    where grpc++, protoc or its gRPC plugin is missing (`make setup` installs them where it can;
    dense-side code then uses grpcio's client) or TANDEM_GRPC_CPP=0."""
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_cpp_plugin")
    if os.environ.get("TANDEM_GRPC_CPP") == "0" or not (protoc and plugin and shutil.which("pkg-config")):
        return None
    try:
        cflags, libs = pkg_config("--cflags"), pkg_config("--libs")
    except subprocess.CalledProcessError:
        return None
    out = Path("build") / "grpc_generated"
    out.mkdir(parents=True, exist_ok=True)
    proto = Path("protos") / "tandem" / "v1" / "expert.proto"
    subprocess.run([protoc, "-Iprotos", f"--cpp_out={out}", f"--grpc_out={out}", f"--plugin=protoc-gen-grpc={plugin}",
                    str(proto)], check=True)
    generated = [str(out / "tandem" / "v1" / name) for name in ("expert.pb.cc", "expert.grpc.pb.cc")]
    return Pybind11Extension(
        "tandem_grpc",
        [*sorted(str(p) for p in (NATIVE / "grpc").glob("*.cpp")), *generated],
        depends=[*sorted(str(p) for p in (NATIVE / "grpc").glob("*")), str(NATIVE / "src" / "copy.h"),
                 str(NATIVE / "include" / "tandem" / "executor_api.h"), str(proto)],
        include_dirs=[str(out), str(NATIVE / "src"), str(NATIVE / "include")],
        extra_compile_args=COMMON_FLAGS + cflags,
        extra_link_args=["-pthread", *libs],
        cxx_std=17,
    )


setup(ext_modules=[e for e in (ext, grpc_extension()) if e is not None], cmdclass={"build_ext": BuildVariants})
