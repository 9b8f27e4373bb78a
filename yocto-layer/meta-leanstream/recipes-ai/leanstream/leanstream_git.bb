SUMMARY = "LeanStream on-device LLM inference service and CLI"
DESCRIPTION = "leanstreamd serves LLM inference to local processes over the D-Bus system bus \
               (io.github.leanstream.LeanStream1), streaming sparse FFN weights from storage with O_DIRECT \
               reads under one memory budget; leanstream is its command line and offline model tools."
HOMEPAGE = "https://github.com/leanstream/leanstream"
BUGTRACKER = "https://github.com/leanstream/leanstream/issues"
CVE_PRODUCT = "leanstream"
SECTION = "console/utils"
# The workspace's license is declared in Cargo.toml ([workspace.package] license).
LICENSE = "Apache-2.0"
LIC_FILES_CHKSUM = "file://Cargo.toml;beginline=11;endline=11;md5=2507bd5f0713f05419cd2f22fa06fe62"

# This layer lives in the same repository as the source, so SRCREV cannot name the commit that
# holds this file: it names an earlier commit (with scripts/install, systemd/ and the `cuda`
# feature) whose Cargo.lock leanstream-crates.inc was generated from (scripts/yocto-crates). Move
# both together. To build
# the checkout next to this layer instead, use externalsrc (docs/install.md, "Yocto").
PV = "0.1.0+git"
SRC_URI = "git://github.com/leanstream/leanstream.git;protocol=https;branch=main"
SRCREV = "bc5bfe2d55b1958933e64e89e8b7707060dadc95"

require ${BPN}-crates.inc

inherit cargo cargo-update-recipe-crates systemd useradd

# The CUDA backend (feature "cuda" of the daemon and the CLI) links libcuda from meta-tegra.
PACKAGECONFIG ??= ""
PACKAGECONFIG[cuda] = "--features leanstreamd/cuda --features leanstream/cuda,,tegra-libraries-cuda,tegra-libraries-cuda"

# The daemon, the CLI and the OpenAI-compatible endpoint; the native variant (model conversion at
# build time) needs the CLI only.
LEANSTREAM_CARGO_PACKAGES = "-p leanstreamd -p leanstream -p leanstream-openai"
LEANSTREAM_CARGO_PACKAGES:class-native = "-p leanstream"

do_compile() {
    oe_cargo_build ${LEANSTREAM_CARGO_PACKAGES} ${PACKAGECONFIG_CONFARGS}
}

# scripts/install is the same command users run by hand; it puts every file in its FHS place.
do_install() {
    "${S}/scripts/install" \
        --destdir "${D}" \
        --prefix "${prefix}" \
        --bindir "${bindir}" \
        --datadir "${datadir}" \
        --sysconfdir "${sysconfdir}" \
        --unitdir "${systemd_system_unitdir}" \
        --sysusersdir "${nonarch_libdir}/sysusers.d" \
        --tmpfilesdir "${nonarch_libdir}/tmpfiles.d" \
        --binaries "${B}/target/${CARGO_TARGET_SUBDIR}"
}

do_install:class-native() {
    install -d "${D}${bindir}"
    install -m 0755 "${B}/target/${CARGO_TARGET_SUBDIR}/leanstream" "${D}${bindir}/leanstream"
}

# leanstream: the service (daemon, unit, D-Bus policy and activation, user, directories, config).
# leanstream-cli: the command line, for people on the device; apps call D-Bus directly.
# leanstream-openai: the OpenAI-compatible HTTP endpoint on a Unix socket, started by its socket
# unit at the first connection.
PACKAGE_BEFORE_PN = "${PN}-cli ${PN}-openai"
FILES:${PN}-cli += "${bindir}/leanstream"
FILES:${PN}-openai += "\
    ${bindir}/leanstream-openai \
    ${systemd_system_unitdir}/leanstream-openai.socket \
    ${systemd_system_unitdir}/leanstream-openai.service \
"
FILES:${PN} += "\
    ${datadir}/dbus-1/system.d/io.github.leanstream.LeanStream1.conf \
    ${datadir}/dbus-1/system-services/io.github.leanstream.LeanStream1.service \
    ${datadir}/dbus-1/interfaces/io.github.leanstream.LeanStream1.xml \
    ${nonarch_libdir}/sysusers.d/leanstream.conf \
    ${nonarch_libdir}/tmpfiles.d/leanstream.conf \
    ${datadir}/leanstream/models \
"
CONFFILES:${PN} = "${sysconfdir}/leanstream/leanstreamd.toml"
RDEPENDS:${PN} = "dbus"
RDEPENDS:${PN}-openai = "${PN}"
RRECOMMENDS:${PN} = "${PN}-cli"

SYSTEMD_PACKAGES = "${PN} ${PN}-openai"
SYSTEMD_SERVICE:${PN} = "leanstreamd.service"
SYSTEMD_AUTO_ENABLE:${PN} = "enable"
SYSTEMD_SERVICE:${PN}-openai = "leanstream-openai.socket"
SYSTEMD_AUTO_ENABLE:${PN}-openai = "enable"

# The same user as systemd/sysusers.conf: static, group leanstream (whose members may call the
# service), supplementary group video (the GPU device nodes).
USERADD_PACKAGES = "${PN}"
USERADD_PARAM:${PN} = "--system --user-group --groups video \
                       --home-dir ${localstatedir}/lib/leanstream --no-create-home \
                       --shell ${base_sbindir}/nologin leanstream"

BBCLASSEXTEND = "native"
