//! Links the library under the CUDA driver's soname, `libcuda.so.1`, so programs linked with
//! `-lcuda` and plugins that `dlopen("libcuda.so.1")` load it.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
