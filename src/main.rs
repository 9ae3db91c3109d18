fn main() {
    std::process::exit(mosaicfs::daemon::main());
}
