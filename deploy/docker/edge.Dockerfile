# edge-client and netsim, no torch: onnxruntime, tokenizers, grpcio, numpy, aiohttp. Build from
# the repository root:
#   docker build -f deploy/docker/edge.Dockerfile -t splitdec-edge .
# BASE: an image with Python 3.11 and its venv module; deploy/images.sh passes one made by
# debootstrap from Debian bookworm's packages where no image registry is reachable. The venv
# keeps pip off the system Python, which Debian's marks externally managed (PEP 668).
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITDEC_CACHE=/cache PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv \
    && useradd --uid 10001 --create-home splitdec \
    && mkdir /cache /results && chown splitdec /cache /results

WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY shared shared
COPY edge_client edge_client
COPY netsim netsim
RUN pip install -c constraints.txt .

USER 10001
# The tokenizer and the MoA drafter bundle, fetched from the server once.
VOLUME /cache
EXPOSE 8000
ENTRYPOINT ["edge-client"]
# By default the OpenAI-compatible endpoint, for a server reachable as `server`; any other
# edge-client command replaces this (compose.yaml runs a batch).
CMD ["serve", "--server", "server:50051", "--host", "0.0.0.0", "--port", "8000"]
