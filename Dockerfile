# One image for the operator (`kvtier operator`), the node agent (`kvtier agent`), the CSI
# node plugin (`kvtier csi`) and the plug-in payload the webhook's init container copies into
# vLLM pods. torch-free: the agent and operator never need it, and the plug-in runs inside
# vLLM's own environment. `make image` builds and verifies this file offline (BASE and
# PIP_OPTIONS point it at a local base and wheelhouse); release pipelines build it as it is.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG PIP_OPTIONS=""
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir ${PIP_OPTIONS} --wheel-dir /wheels -r requirements/base.txt \
 && pip wheel --no-cache-dir ${PIP_OPTIONS} --no-deps --wheel-dir /wheels . \
 && pip download --no-cache-dir ${PIP_OPTIONS} --no-deps --dest /wheels/nixl \
        -r requirements/nixl.txt \
 && python tools/plugin_payload.py /src /plugin

FROM ${BASE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.source="https://kvtier.io/source" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.title="kvtier" \
      org.opencontainers.image.licenses="Apache-2.0"
# The wheels are bind-mounted from the build stage, so no layer keeps them.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --no-compile /wheels/*.whl \
 && pip install --no-cache-dir --no-index --no-deps --no-compile /wheels/nixl/*.whl \
 && rm -rf "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nixl_ep_cu12" \
 && groupadd --gid 65532 kvtier \
 && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin kvtier
# The plug-in payload (tools/plugin_payload.py: the plug-in's packages only, none of the agent,
# operator, CSI plugin or CLI), made in the build stage from the same source as the wheel.
COPY --from=build /plugin /opt/kvtier/plugin
USER 65532:65532
ENTRYPOINT ["kvtier"]
CMD ["--help"]
