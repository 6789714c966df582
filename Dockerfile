# One image for the operator (`kvtier operator`), the node agent (`kvtier agent`) and the
# plug-in payload the webhook's init container copies into vLLM pods. torch-free: the agent
# and operator never need it, and the plug-in runs inside vLLM's own environment.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements requirements
COPY kvtier kvtier
COPY agent agent
COPY operator operator
COPY bench bench
RUN pip wheel --no-cache-dir --wheel-dir /wheels -r requirements/base.txt \
 && pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && pip download --no-cache-dir --no-deps --dest /wheels-nixl -r requirements/nixl.txt

FROM python:3.11-slim
COPY --from=build /wheels /wheels
COPY --from=build /wheels-nixl /wheels-nixl
RUN pip install --no-cache-dir --no-index /wheels/*.whl \
 && pip install --no-cache-dir --no-index --no-deps /wheels-nixl/*.whl \
 && rm -rf /wheels /wheels-nixl \
 && mkdir -p /opt/kvtier/plugin \
 && cp -r "$(python -c 'import kvtier, os; print(os.path.dirname(kvtier.__file__))')" \
          /opt/kvtier/plugin/ \
 && useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin kvtier
USER 65532:65532
ENTRYPOINT ["kvtier"]
CMD ["--help"]
