"""The compiled part of S-MoE: smoe._cpu_kernels (csrc/), MLX's Linux CPU matmuls bit for bit
at the cores' speed (docs/performance.md, "CPU arithmetic"). Everything else is declared in
pyproject.toml. The extension is optional: where it cannot be built (no C compiler), the
install goes on and MLX's own kernels run (`smoe generate` says which arithmetic runs)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "smoe._cpu_kernels",
            sources=["csrc/cpu_kernels.c"],
            depends=[
                "csrc/cpu_kernels_impl.h",
                "csrc/cpu_kernels_avx2.h",
                "csrc/cpu_kernels_avx512.h",
                "csrc/cpu_kernels_scalar.h",
            ],
            # No fused multiply-add: MLX rounds the product and the sum separately. The
            # instruction sets are chosen at run time (no -march), per function.
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
