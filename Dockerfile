FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY services ./services
COPY scripts ./scripts
COPY deploy ./deploy
RUN pip install --no-cache-dir .
# Convert the default model once at build time; SPECMESH_MODEL_CACHE points the services at it.
ENV SPECMESH_MODEL_CACHE=/models
RUN specmesh models prepare
EXPOSE 50051 50052 50053 50054
CMD ["specmesh", "serve", "router", "--host", "0.0.0.0"]
