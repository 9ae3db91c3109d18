//! The command line: which command, its arguments, and the usage texts.

use super::*;

/// What the command line asks for.
#[derive(Debug)]
pub enum Command {
    Mount(Box<Options>),
    /// Change the flags of a live mount (read-only or read-write).
    Remount(Box<Options>),
    /// Print the counters of a live mount.
    Status(PathBuf, Format),
    /// `mosaicfs metrics --listen ADDR`: every mount's metrics at one address.
    Metrics(std::net::SocketAddr),
    /// `mosaicfs sync MNT`: write the memory upper's image now.
    Sync(PathBuf),
    /// `mosaicfs upgrade MNT [--binary PATH]`: a new daemon takes the live mount over
    /// (takeover.rs).
    Upgrade(PathBuf, Option<PathBuf>),
    /// `mosaicfs complete`: make an unmounted upper layer one any overlay reads (tools.rs).
    Complete(Box<ToolArgs>),
    /// `mosaicfs fsck`: check (and repair) an unmounted upper layer (tools.rs).
    Fsck(Box<ToolArgs>),
    /// `mosaicfs export`: the upper layer as an OCI layer tar (export.rs).
    Export(Box<ExportArgs>),
    /// `--help`, or the help of one command.
    Help(Option<String>),
    Version,
}

pub const USAGE: &str = "\
usage: mosaicfs [-f] [-d] -o lowerdir=LOWER[:LOWER...][,upperdir=UPPER,workdir=WORK][,OPTIONS] MOUNTPOINT
       mosaicfs SOURCE MOUNTPOINT -o lowerdir=...   (mount.fuse form)
       mosaicfs status MOUNTPOINT [--json|--prometheus]  (counters of a live mount)
       mosaicfs metrics --listen ADDR:PORT  (every mount's metrics, one Prometheus target)
       mosaicfs sync MOUNTPOINT  (upper=memory: the layer made durable as it is now)
       mosaicfs upgrade MOUNTPOINT [--binary PATH]  (a new daemon takes the live mount over)
       mosaicfs complete --lowerdir=L[:L...] --upperdir=U --workdir=W [--redirects=kernel|copy]
                         (offline: partial files made whole, redirects for kernel overlayfs)
       mosaicfs fsck --lowerdir=L[:L...] --upperdir=U [--workdir=W] [--repair]
                         (offline: check the layer's marks, redirects and work dir)
       mosaicfs export [-o FILE] [--gzip|--zstd] [-q] (MOUNTPOINT | --lowerdir=L[:L...] --upperdir=U [--workdir=W])
                         (the upper layer as an OCI layer tar, live or offline)
       mosaicfs --version | --help | help [CMD] | CMD --help

  -f            stay in the foreground
  -d, --debug   foreground, log every request to stderr
  -o OPTIONS    comma-separated mount options (below)

Without upperdir the overlay is read-only.";

/// What `complete` makes of a directory a rename gave a redirect (tools.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redirects {
    /// `trusted.overlay.redirect` / `user.overlay.redirect`, which kernel overlayfs follows.
    Kernel,
    /// The lower tree copied into the directory, made opaque: for overlays without
    /// redirects (fuse-overlayfs).
    Copy,
}

/// The arguments of the offline commands: the layers as mount options, and the command's own.
#[derive(Debug)]
pub struct ToolArgs {
    pub opts: Options,
    pub repair: bool,
    pub redirects: Redirects,
}

fn parse_tool(command: &str, args: &[OsString]) -> Result<ToolArgs> {
    let usage = match command {
        "complete" => {
            "usage: mosaicfs complete --lowerdir=L[:L...] --upperdir=U --workdir=W [--redirects=kernel|copy]"
        }
        _ => "usage: mosaicfs fsck --lowerdir=L[:L...] --upperdir=U [--workdir=W] [--repair]",
    };
    let mut t = ToolArgs {
        opts: Options::default(),
        repair: false,
        redirects: Redirects::Kernel,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let s = arg.to_string_lossy();
        match s.as_ref() {
            "--repair" if command == "fsck" => t.repair = true,
            "--redirects=kernel" if command == "complete" => t.redirects = Redirects::Kernel,
            "--redirects=copy" if command == "complete" => t.redirects = Redirects::Copy,
            "-o" => {
                let v = args
                    .next()
                    .ok_or(format!("-o needs an argument\n{usage}"))?;
                for opt in split_options(&v.to_string_lossy()) {
                    t.opts.apply(&opt)?;
                }
            }
            // Any mount option as `--NAME=VALUE`, one value each (commas are not separators).
            a if a.starts_with("--") && a.contains('=') && !a.starts_with("--redirects=") => {
                t.opts.apply(&a[2..])?
            }
            a => return Err(crate::message!("unknown argument '{a}'\n{usage}")),
        }
    }
    if t.opts.lowerdirs.is_empty() {
        return Err(crate::message!(
            "no lower layers given: pass --lowerdir=DIR[:DIR...] as the layer is mounted\n{usage}"
        ));
    }
    if t.opts.upperdir.is_none() {
        return Err(crate::message!(
            "no upper layer given: pass --upperdir=DIR\n{usage}"
        ));
    }
    if t.opts.workdir.is_none() && (command == "complete" || t.repair) {
        return Err(crate::message!(
            "--workdir=DIR is needed: the work dir the layer is mounted with (scratch space on \
             the upper file system)\n{usage}"
        ));
    }
    Ok(t)
}

/// Where `mosaicfs export` reads the layer.
#[derive(Debug)]
pub enum ExportFrom {
    /// A live mount, through its daemon.
    Mount(PathBuf),
    /// Unmounted layers, as mount options (lowerdir, upperdir, optional workdir).
    Dirs(Box<Options>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

#[derive(Debug)]
pub struct ExportArgs {
    pub from: ExportFrom,
    /// The archive's file; standard output without it.
    pub output: Option<PathBuf>,
    pub compression: Compression,
    /// No progress bar and no summary.
    pub quiet: bool,
}

const EXPORT_USAGE: &str = "usage: mosaicfs export [-o FILE] [--gzip|--zstd] [-q] \
     (MOUNTPOINT | --lowerdir=L[:L...] --upperdir=U [--workdir=W])";

fn parse_export(args: &[OsString]) -> Result<ExportArgs> {
    let mut opts = Options::default();
    let mut mnt = None;
    let mut output = None;
    let mut compression = None;
    let mut quiet = false;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let s = arg.to_string_lossy();
        let mut compress = |c| match compression.replace(c) {
            Some(old) if old != c => Err(crate::message!("choose one compression\n{EXPORT_USAGE}")),
            _ => Ok(()),
        };
        match s.as_ref() {
            "-o" | "--output" => {
                let v = args
                    .next()
                    .ok_or(format!("{s} needs a file name\n{EXPORT_USAGE}"))?;
                output = Some(PathBuf::from(v));
            }
            a if a.starts_with("--output=") => output = Some(PathBuf::from(&a[9..])),
            "--gzip" | "-z" | "--compress=gzip" => compress(Compression::Gzip)?,
            "--zstd" | "--compress=zstd" => compress(Compression::Zstd)?,
            "--compress=none" => compress(Compression::None)?,
            "-q" | "--quiet" => quiet = true,
            a if a.starts_with("--") && a.contains('=') => opts.apply(&a[2..])?,
            a if a.starts_with('-') => {
                return Err(crate::message!("unknown argument '{a}'\n{EXPORT_USAGE}"));
            }
            _ if mnt.is_none() => mnt = Some(PathBuf::from(arg)),
            a => return Err(crate::message!("unexpected argument '{a}'\n{EXPORT_USAGE}")),
        }
    }
    let from = match (mnt, opts.lowerdirs.is_empty(), opts.upperdir.is_some()) {
        (Some(m), true, false) => ExportFrom::Mount(m),
        (None, false, true) => ExportFrom::Dirs(Box::new(opts)),
        (Some(_), _, _) => {
            return Err(crate::message!(
                "give a mount point or the layers' dirs, not both\n{EXPORT_USAGE}"
            ));
        }
        (None, true, _) => {
            return Err(crate::message!(
                "nothing to export: name a live mount, or the dirs of an unmounted layer with \
                 --lowerdir=L --upperdir=U\n{EXPORT_USAGE}"
            ));
        }
        (None, false, false) => {
            return Err(crate::message!(
                "no upper layer given: pass --upperdir=DIR (the layer to export)\n{EXPORT_USAGE}"
            ));
        }
    };
    // Compression follows the file name when not given; a name that asks for one mosaicfs does
    // not write is an error, not an uncompressed file under that name.
    let by_name = match output.as_ref().map(|p| p.to_string_lossy().into_owned()) {
        Some(n) if n.ends_with(".gz") || n.ends_with(".tgz") => Some(Compression::Gzip),
        Some(n) if n.ends_with(".zst") || n.ends_with(".tzst") => Some(Compression::Zstd),
        Some(n) if compression.is_none() => {
            let other = [".xz", ".txz", ".bz2", ".tbz2", ".lz4", ".lzma", ".Z"];
            if let Some(ext) = other.iter().find(|e| n.ends_with(*e)) {
                return Err(crate::message!(
                    "'{n}' names {ext} compression, which export does not write: use .gz or .zst, \
                     or --compress=none for a plain tar under that name\n{EXPORT_USAGE}"
                ));
            }
            None
        }
        _ => None,
    };
    Ok(ExportArgs {
        from,
        output,
        compression: compression.or(by_name).unwrap_or(Compression::None),
        quiet,
    })
}

fn parse_listen(addr: &std::ffi::OsStr) -> Result<Command> {
    let a = addr.to_string_lossy();
    a.parse().map(Command::Metrics).map_err(|_| {
        crate::message!(
            "metrics --listen takes an address and port such as 127.0.0.1:9100, not '{a}'"
        )
    })
}

/// Parses the whole command line (without argv[0]). One piece: one arm per command.
pub fn parse_args<I: IntoIterator<Item = OsString>>(args: I) -> Result<Command> {
    let args: Vec<OsString> = args.into_iter().collect();
    let first = args.first().and_then(|a| a.to_str());
    if first == Some("help") {
        return match args.get(1).and_then(|a| a.to_str()) {
            None => Ok(Command::Help(None)),
            Some(cmd) if crate::help::command_help(cmd).is_some() => {
                Ok(Command::Help(Some(cmd.to_string())))
            }
            Some(other) => Err(crate::message!(
                "no help for '{other}': 'mosaicfs help' shows the mount options, and \
                 'mosaicfs help CMD' a command: {}",
                crate::help::COMMANDS.map(|(c, _)| c).join(", ")
            )),
        };
    }
    // `mosaicfs CMD --help` (a mount needs `-o`, so a subcommand word comes first).
    if let Some(cmd) = first
        && crate::help::command_help(cmd).is_some()
        && args[1..].iter().any(|a| a == "--help" || a == "-h")
    {
        return Ok(Command::Help(Some(cmd.to_string())));
    }
    if first == Some("metrics") {
        return match args.get(1..).unwrap_or_default() {
            [flag, addr] if flag == "--listen" => parse_listen(addr),
            [one] if one.to_str().is_some_and(|a| a.starts_with("--listen=")) => parse_listen(
                std::ffi::OsStr::new(&one.to_str().unwrap_or_default()["--listen=".len()..]),
            ),
            _ => Err(crate::help::COMMANDS[5].1.into()),
        };
    }
    if args.first().is_some_and(|a| a == "status") {
        return match args.get(1..) {
            Some([mnt]) => Ok(Command::Status(PathBuf::from(mnt), Format::Text)),
            Some([mnt, f]) | Some([f, mnt]) if f == "--json" || f == "--prometheus" => {
                let format = if f == "--json" {
                    Format::Json
                } else {
                    Format::Prometheus
                };
                Ok(Command::Status(PathBuf::from(mnt), format))
            }
            _ => Err("usage: mosaicfs status MOUNTPOINT [--json | --prometheus]".into()),
        };
    }
    if args.first().is_some_and(|a| a == "upgrade") {
        const USAGE: &str = "usage: mosaicfs upgrade MOUNTPOINT [--binary PATH]";
        return match args.get(1..) {
            Some([mnt]) => Ok(Command::Upgrade(PathBuf::from(mnt), None)),
            Some([mnt, flag, bin]) if flag == "--binary" => Ok(Command::Upgrade(
                PathBuf::from(mnt),
                Some(PathBuf::from(bin)),
            )),
            Some([flag, bin, mnt]) if flag == "--binary" => Ok(Command::Upgrade(
                PathBuf::from(mnt),
                Some(PathBuf::from(bin)),
            )),
            _ => Err(USAGE.into()),
        };
    }
    match args.first().and_then(|a| a.to_str()) {
        // Two words only: `mosaicfs sync MNT -o ...` is the mount.fuse form with source "sync".
        Some("sync") if args.len() == 2 => return Ok(Command::Sync(PathBuf::from(&args[1]))),
        Some("complete") => {
            return Ok(Command::Complete(Box::new(parse_tool(
                "complete",
                &args[1..],
            )?)));
        }
        Some("fsck") => return Ok(Command::Fsck(Box::new(parse_tool("fsck", &args[1..])?))),
        Some("export") => return Ok(Command::Export(Box::new(parse_export(&args[1..])?))),
        _ => {}
    }
    let mut opts = Options {
        uring: Uring::from_env()?,
        ..Options::default()
    };
    let mut positional: Vec<OsString> = Vec::new();
    let mut option_strings: Vec<String> = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let s = arg.to_string_lossy().into_owned();
        match s.as_str() {
            "-h" | "--help" => return Ok(Command::Help(None)),
            "-V" | "--version" => return Ok(Command::Version),
            "-f" => opts.foreground = true,
            "-d" | "--debug" => {
                opts.debug = true;
                opts.foreground = true;
            }
            "-s" => {} // single-threaded libfuse flag: accepted, the daemon decides its threads
            "-o" => {
                let v = args
                    .next()
                    .ok_or("-o needs an argument: -o lowerdir=...,upperdir=...,workdir=...")?;
                option_strings.push(v.to_string_lossy().into_owned());
            }
            _ if s.starts_with("-o") => option_strings.push(s[2..].to_string()),
            _ if s.starts_with('-') && s.len() > 1 => {
                return Err(crate::message!(
                    "unknown argument '{s}': see 'mosaicfs --help'"
                ));
            }
            _ => positional.push(arg),
        }
    }
    for o in &option_strings {
        for opt in split_options(o) {
            opts.apply(&opt)?;
        }
    }
    match positional.len() {
        1 => opts.mountpoint = PathBuf::from(&positional[0]),
        2 => {
            opts.fsname = positional[0].to_string_lossy().into_owned();
            opts.mountpoint = PathBuf::from(&positional[1]);
        }
        0 => return Err(("no mount point given\n".to_string() + USAGE).into()),
        _ => {
            return Err(crate::message!(
                "too many arguments: {positional:?}\n{USAGE}"
            ));
        }
    }
    if opts.remount {
        return Ok(Command::Remount(Box::new(opts)));
    }
    if option_strings.is_empty()
        && let Some(word) = positional.first().and_then(|w| w.to_str())
        && !word.contains('/')
    {
        // A mount always has -o; a bare first word was meant as a command.
        return Err(not_a_command(word).into());
    }
    if opts.lowerdirs.is_empty() {
        return Err("no lowerdir given: pass -o lowerdir=DIR[:DIR...]".into());
    }
    if opts.upperdir.is_some() != opts.workdir.is_some() {
        return Err(
            "upperdir and workdir go together: give both, or neither for a read-only overlay"
                .into(),
        );
    }
    if opts.upperdir.is_none() {
        opts.read_only = true;
    }
    check_memory_upper(&opts)?;
    opts.check_metacopy()?;
    Ok(Command::Mount(Box::new(opts)))
}

/// What `mosaicfs WORD ...` says when WORD is no command: the commands, and the nearest one.
fn not_a_command(word: &str) -> String {
    let commands: Vec<&str> = crate::help::COMMANDS.iter().map(|(c, _)| *c).collect();
    let near = commands
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        .min()
        .filter(|(d, _)| *d <= 2)
        .map_or(String::new(), |(_, c)| format!(" (did you mean '{c}'?)"));
    format!(
        "'{word}' is not a mosaicfs command{near}. Commands: {}, help.\n\
         To mount: mosaicfs -o lowerdir=DIR[:DIR...],upperdir=DIR,workdir=DIR MOUNTPOINT \
         (mosaicfs --help)",
        commands.join(", ")
    )
}

/// Levenshtein distance between two short words.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let here = (prev + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            prev = row[j + 1];
            row[j + 1] = here;
        }
    }
    row[b.len()]
}
