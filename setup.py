"""Builds the optional C extension ``sparkgpu._native``; all metadata lives in pyproject.toml.

The extension is marked optional: where no C compiler is available the build goes on
without it and ``sparkgpu.data`` falls back to its numpy paths.
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
        )
    ]
)
