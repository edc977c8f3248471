# The orchestrator's image: the Prefect worker, the Event Grid relay, the outputs gateway and
# the MLflow server on Container Apps (infra/main.json) run this project from /app. Built by
# ACR Tasks from the project's tracked files (`make azure-up`); no GPU, no Horovod: the
# training runs on the Batch pool in the training image (docker/Dockerfile).
FROM python:3.11-slim-bookworm
WORKDIR /app
COPY . /app
# torch's CPU build: the orchestrator imports the trainer's argument model, never CUDA.
RUN python -m pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && python -m pip install --no-cache-dir -c constraints.txt . \
 && useradd --create-home --uid 10001 retrain \
 && mkdir -p /app/.work && chown -R retrain /app/configs /app/.work
USER retrain
ENV PREFECT_SERVER_ANALYTICS_ENABLED=false PYTHONUNBUFFERED=1
