from setuptools import find_packages, setup

setup(
    name="meshlm",
    version="0.1.0",
    description="A JAX trainer for LLaMA-family language models: one flag-driven script, "
                "dp/fsdp/tp meshes, Hugging Face interop, spot-ready checkpoints.",
    packages=find_packages(include=["trainer", "trainer.*"]),
    package_data={"trainer": ["chat.html"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10",
        "jaxlib>=0.10",
        "flax>=0.12",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12",
        "absl-py",
        "transformers==5.24.0",
        "tokenizers",
        "jinja2",  # chat templates (transformers renders them with it, but does not require it)
        "sentencepiece",
        "safetensors",
        "huggingface_hub",
        "fsspec",
        "gcsfs",
        "zstandard",  # .zst corpora (fsspec's zstd codec)
        "tqdm",
        "datasets",
        "numpy",
        "ml_dtypes",
        "fastapi",  # trainer.serve
        "uvicorn",
    ],
    extras_require={
        "test": ["pytest", "torch==2.13.0", "gcp-storage-emulator", "peft==0.21.2",
                 "lm-eval==0.4.13", "openai", "playwright", "datatrove==0.10.1"],
        # trainer.tokenize on every core or many machines (~20 MB, pure Python, no cluster runtime)
        "data": ["datatrove==0.10.1"],
        "tpu": ["jax[tpu]"],
        "cuda": ["jax[cuda12]"],
        # lm-eval-harness tasks (python -m trainer.eval --tasks=...); lm-eval pulls torch
        "eval": ["lm-eval==0.4.13"],
    },
)
