# leanstream_model: installs one model for leanstreamd into the image.
#
# The recipe fetches a GGUF file, a Hugging Face safetensors directory (config.json,
# *.safetensors, tokenizer.json) or a ready .lsm file. At build time the class converts it with
# the host's `leanstream convert` (leanstream-native), optionally calibrates it for the sparse
# modes, and installs ${LEANSTREAM_MODEL_NAME}.lsm into ${LEANSTREAM_MODEL_DIR}, the model
# directory of leanstreamd's default configuration. Clients then name it LEANSTREAM_MODEL_NAME.
#
# Variables:
#   LEANSTREAM_MODEL_SOURCE    the fetched model, relative to ${UNPACKDIR} (required)
#   LEANSTREAM_MODEL_NAME      the model's name for clients (default: BPN less "leanstream-model-")
#   LEANSTREAM_CONVERT_ARGS    extra `leanstream convert` arguments, e.g. "--chunk-neurons 2"
#   LEANSTREAM_CALIBRATE_ARGS  when set, `leanstream calibrate` runs with these arguments (e.g.
#                              "--sparsity 0.4"); it runs the dense model on the build
#                              host, which takes a while for large models
#
# Example: recipes-ai/leanstream-models/leanstream-model-smollm2_0.1.2.bb

LEANSTREAM_MODEL_SOURCE ??= ""
LEANSTREAM_MODEL_NAME ??= "${@d.getVar('BPN').removeprefix('leanstream-model-')}"
LEANSTREAM_CONVERT_ARGS ??= ""
LEANSTREAM_CALIBRATE_ARGS ??= ""
LEANSTREAM_MODEL_DIR = "${datadir}/leanstream/models"

# A model file is the same on every machine.
inherit allarch

DEPENDS += "leanstream-native"

S = "${UNPACKDIR}"
B = "${WORKDIR}/build"

do_configure[noexec] = "1"

do_compile() {
    if [ -z "${LEANSTREAM_MODEL_SOURCE}" ]; then
        bbfatal "set LEANSTREAM_MODEL_SOURCE to the fetched model (relative to UNPACKDIR)"
    fi
    src="${UNPACKDIR}/${LEANSTREAM_MODEL_SOURCE}"
    out="${B}/${LEANSTREAM_MODEL_NAME}.lsm"
    rm -f "$out"
    case "$src" in
    *.lsm)
        cp "$src" "$out"
        ;;
    *)
        leanstream convert "$src" -o "$out" ${LEANSTREAM_CONVERT_ARGS}
        ;;
    esac
    if [ -n "${LEANSTREAM_CALIBRATE_ARGS}" ]; then
        leanstream calibrate "$out" ${LEANSTREAM_CALIBRATE_ARGS}
    fi
}
do_compile[cleandirs] = "${B}"

do_install() {
    install -d "${D}${LEANSTREAM_MODEL_DIR}"
    install -m 0644 "${B}/${LEANSTREAM_MODEL_NAME}.lsm" "${D}${LEANSTREAM_MODEL_DIR}/"
}

FILES:${PN} += "${LEANSTREAM_MODEL_DIR}/${LEANSTREAM_MODEL_NAME}.lsm"
RRECOMMENDS:${PN} += "leanstream"
