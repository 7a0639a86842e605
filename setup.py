"""Builds the native kernels (tandem_native): each ISA variant compiled with only its own flags."""

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

setup(ext_modules=[ext], cmdclass={"build_ext": BuildVariants})
