//! Compiles the kernel sources (`cuda-kernels/src/`, or the directory named by
//! `LEANSTREAM_CUDA_HOST_SRC`, which `host-check --break` points at a copy with an injected bug)
//! as C++20 for the host, one translation unit per `.cu` through its launcher file.

use std::env;
use std::path::PathBuf;

const LAUNCHERS: [&str; 5] = ["attention", "elementwise", "ffn", "matvec", "sample"];

fn main() {
    let here = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let src = env::var_os("LEANSTREAM_CUDA_HOST_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| here.join("../src"));
    println!("cargo:rerun-if-env-changed=LEANSTREAM_CUDA_HOST_SRC");
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-changed=cuda_host.h");
    println!("cargo:rerun-if-changed=launchers");
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .include(&here)
        .include(&src)
        .files(LAUNCHERS.map(|l| here.join(format!("launchers/{l}.cpp"))))
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        // The sources' `#pragma unroll` is for NVRTC.
        .flag("-Wno-unknown-pragmas")
        .compile("leanstream_cuda_host");
}
