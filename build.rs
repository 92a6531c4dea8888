//! Link settings of this crate's binaries, tests and examples.

fn main() {
    // `store::crc` defines RocksDB's CRC32C function; export it in the
    // dynamic symbol table (and keep it: `-u` pulls its object file in),
    // so that librocksdb's calls resolve to it instead of its own table
    // loop. See `src/store/crc.rs`.
    const SYMBOL: &str = "_ZN7rocksdb6crc32c6ExtendEjPKcm";
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg=-Wl,-u,{SYMBOL}");
        println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol={SYMBOL}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
