# syntax=docker/dockerfile:1
# The raykv image: the Ray image of the version raykv supports, plus raykv (CUDA kernel sources
# included) and torch. One command from the repository root builds the wheel and the image:
#   docker build -t <registry>/raykv:0.1.0-gpu .
#   docker build --build-arg RAY_IMAGE_TAG=2.60.0-py311 -t <registry>/raykv:0.1.0-cpu .
# RAY_IMAGE_TAG must match the chart's rayVersion (helm/raykv/values.yaml) and pyproject's Ray
# range. The image keeps Ray's user (uid 1000), which the chart's security context requires.
ARG RAY_IMAGE=rayproject/ray
ARG RAY_IMAGE_TAG=2.60.0-py311-gpu

# Stage 1: the wheel, built from this checkout (kernels/ ships inside it as raykv/_kernels).
FROM ${RAY_IMAGE}:${RAY_IMAGE_TAG} AS wheel
WORKDIR /home/ray
COPY --chown=1000:100 pyproject.toml setup.py README.md raykv-src/
COPY --chown=1000:100 raykv raykv-src/raykv
COPY --chown=1000:100 kernels raykv-src/kernels
RUN python -m pip wheel --no-deps --no-cache-dir -w /home/ray/dist ./raykv-src

# Stage 2: the runtime image: the same Ray image with the wheel installed.
FROM ${RAY_IMAGE}:${RAY_IMAGE_TAG}
# The torch build to install (the default index's Linux wheels are CUDA builds); ray is pinned
# to the image's own version so installing raykv never moves it.
ARG TORCH_SPEC="torch==2.13.0"
# the UCX transport between hosts (ucxx for CUDA 12; it also runs on hosts without a GPU) and
# the object-store tier's S3 client (boto3)
ARG RAYKV_EXTRAS="ucx,s3"
RUN --mount=type=bind,from=wheel,source=/home/ray/dist,target=/tmp/raykv-dist \
    RAY_VERSION="$(python -c 'import ray; print(ray.__version__)')" \
    && python -m pip install --no-cache-dir "ray[default]==${RAY_VERSION}" "${TORCH_SPEC}" \
        "$(ls /tmp/raykv-dist/raykv-*.whl)[${RAYKV_EXTRAS}]" \
    && raykv --help >/dev/null \
    && python -c "from raykv import ops; d = ops.kernel_sources_dir(); assert (d / 'paged_copy.cu').is_file(), d"
