"""Builds the optional C extensions; all metadata lives in pyproject.toml.

``sparkgpu._native`` gathers batches from memory-mapped shards; ``sparkgpu._jpeg`` decodes JPEG
crops into batches with a libjpeg it loads at run time (so it builds against the headers in
native/jpeg/ and links no JPEG library). Both are optional: where no C compiler is available
the build goes on without them and ``sparkgpu.data`` falls back to its numpy and torchvision
paths.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sparkgpu._native",
            sources=["native/gather.c"],
            extra_compile_args=["-O3", "-std=c99"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "sparkgpu._jpeg",
            sources=["native/jpeg_crop.c"],
            include_dirs=["native/jpeg"],
            depends=["native/jpeg/jpeglib.h", "native/jpeg/jmorecfg.h", "native/jpeg/jconfig.h"],
            extra_compile_args=["-O3", "-std=c99"],
            extra_link_args=["-ldl", "-pthread"],
            optional=True,
        ),
    ]
)
