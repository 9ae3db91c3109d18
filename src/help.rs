//! `--help` text, rendered from the man page (docs/mosaicfs.1) so that the two cannot drift:
//! `mosaicfs --help` lists the OPTIONS section, `mosaicfs help CMD` and `mosaicfs CMD --help`
//! the command's entry of the COMMANDS section, each after its usage lines.
//!
//! The renderer knows the few roff requests the page uses (`.SS .TP .PP .RS .RE .br .nf .fi`
//! and the font macros) and its escapes; anything else is dropped, never shown raw.

const MAN_PAGE: &str = include_str!("../docs/mosaicfs.1");
const WIDTH: usize = 79;

/// The subcommands with a help of their own, and their usage lines.
pub const COMMANDS: [(&str, &str); 7] = [
    (
        "status",
        "usage: mosaicfs status MOUNTPOINT [--json | --prometheus]",
    ),
    ("sync", "usage: mosaicfs sync MOUNTPOINT"),
    (
        "upgrade",
        "usage: mosaicfs upgrade MOUNTPOINT [--binary PATH]",
    ),
    (
        "complete",
        "usage: mosaicfs complete --lowerdir=L[:L...] --upperdir=U --workdir=W \
         [--redirects=kernel|copy]",
    ),
    (
        "fsck",
        "usage: mosaicfs fsck --lowerdir=L[:L...] --upperdir=U [--workdir=W] [--repair]",
    ),
    (
        "export",
        "usage: mosaicfs export [-o FILE] [--gzip|--zstd] [-q] \
         (MOUNTPOINT | --lowerdir=L[:L...] --upperdir=U [--workdir=W])",
    ),
    ("metrics", "usage: mosaicfs metrics --listen ADDR:PORT"),
];

/// `mosaicfs --help`: the usage, then every mount option as the man page describes it.
pub fn mount_help(usage: &str) -> String {
    format!(
        "{usage}\n\nOPTIONS (from mosaicfs(1))\n{}",
        render(section("OPTIONS"))
    )
}

/// `mosaicfs help CMD`: the command's usage and its entry of the man page; `None` for a
/// command there is none of.
pub fn command_help(cmd: &str) -> Option<String> {
    let (_, usage) = COMMANDS.iter().find(|(c, _)| *c == cmd)?;
    Some(format!("{usage}\n\n{}", render(&command_entry(cmd))))
}

/// The lines of section `name`, up to the next `.SH`.
fn section(name: &str) -> &'static str {
    let head = format!(".SH {name}\n");
    let Some(start) = MAN_PAGE.find(&head).map(|i| i + head.len()) else {
        return "";
    };
    let len = MAN_PAGE[start..]
        .find("\n.SH ")
        .map_or(MAN_PAGE.len() - start, |i| i + 1);
    &MAN_PAGE[start..start + len]
}

/// The `.TP` entry of COMMANDS whose term names `cmd`, with its nested `.RS` block.
fn command_entry(cmd: &str) -> String {
    let lines: Vec<&str> = section("COMMANDS").lines().collect();
    let mut out = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    while i < lines.len() {
        let term_of_cmd = lines[i] == ".TP"
            && lines
                .get(i + 1)
                .is_some_and(|t| words_of(t).first() == Some(&cmd.to_string()));
        if out.is_empty() && !term_of_cmd {
            i += 1;
            continue;
        }
        match lines[i] {
            ".RS" => depth += 1,
            ".RE" => depth -= 1,
            ".TP" if depth == 0 && !out.is_empty() => break,
            _ => {}
        }
        out.push(lines[i]);
        i += 1;
    }
    out.join("\n")
}

/// The words a line shows, for matching a term.
fn words_of(line: &str) -> Vec<String> {
    text_of(line)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// What one line of roff shows: a font macro's arguments joined (with spaces for `.B`/`.I`,
/// without for the alternating ones), escapes resolved; `\c` at the end is kept as a marker
/// that the next line continues this word.
fn text_of(line: &str) -> String {
    let Some(rest) = line.strip_prefix('.') else {
        return unescape(line);
    };
    let (mac, args) = rest.split_once(' ').unwrap_or((rest, ""));
    let args = split_args(args);
    let joined = match mac {
        "B" | "I" => args.join(" "),
        "BI" | "BR" | "IB" | "IR" | "RB" | "RI" => args.concat(),
        _ => return String::new(),
    };
    unescape(&joined)
}

/// Macro arguments: words, or double-quoted strings with their spaces.
fn split_args(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut any = false;
    for c in s.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            ' ' if !quoted => {
                if any || !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            c => cur.push(c),
        }
    }
    if any || !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('-') => out.push('-'),
            Some('e') => out.push('\\'),
            Some('&') => {}
            Some('c') => out.push('\u{1}'),
            Some('f') => {
                chars.next();
            }
            Some(other) => out.push(other),
            None => {}
        }
    }
    out
}

/// Renders roff lines as plain text: a `.TP` term at indent 2 and its paragraph at 8, `.SS`
/// headings as their own line, `.RS` blocks indented further, text filled to `WIDTH`.
fn render(roff: &str) -> String {
    let mut out = String::new();
    let mut para = String::new();
    let mut indent = 2;
    let mut base = 0;
    let mut term_next = false;
    let mut preformatted = false;
    let flush = |para: &mut String, out: &mut String, indent: usize| {
        let text = para.replace('\u{1}', "");
        if !text.trim().is_empty() {
            out.push_str(&fill(&text, indent));
        }
        para.clear();
    };
    for line in roff.lines() {
        let request = line.split(' ').next().unwrap_or("");
        match request {
            ".TP" => {
                flush(&mut para, &mut out, indent);
                term_next = true;
                continue;
            }
            ".SS" => {
                flush(&mut para, &mut out, indent);
                out.push_str(&format!("\n{}:\n", unescape(line[3..].trim())));
                continue;
            }
            ".PP" => {
                flush(&mut para, &mut out, indent);
                out.push('\n');
                continue;
            }
            ".br" => {
                flush(&mut para, &mut out, indent);
                continue;
            }
            ".RS" => {
                flush(&mut para, &mut out, indent);
                base += 4;
                indent = base + 8;
                continue;
            }
            ".RE" => {
                flush(&mut para, &mut out, indent);
                base = base.saturating_sub(4);
                indent = base + 8;
                continue;
            }
            ".nf" | ".fi" => {
                flush(&mut para, &mut out, indent);
                preformatted = request == ".nf";
                continue;
            }
            _ => {}
        }
        let text = text_of(line);
        if term_next {
            para.push_str(&text);
            if !text.ends_with('\u{1}') {
                out.push_str(&format!(
                    "{}{}\n",
                    " ".repeat(base + 2),
                    para.replace('\u{1}', "")
                ));
                para.clear();
                term_next = false;
                indent = base + 8;
            }
            continue;
        }
        if preformatted {
            out.push_str(&format!("{}{text}\n", " ".repeat(indent)));
            continue;
        }
        if !para.is_empty() && !para.ends_with('\u{1}') {
            para.push(' ');
        }
        para.push_str(&text);
    }
    flush(&mut para, &mut out, indent);
    out
}

/// `text` filled into lines of at most `WIDTH` columns, each indented by `indent`.
fn fill(text: &str, indent: usize) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && indent + line.len() + 1 + word.len() > WIDTH {
            out.push_str(&format!("{}{line}\n", " ".repeat(indent)));
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        out.push_str(&format!("{}{line}\n", " ".repeat(indent)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_option_of_the_man_page_is_in_the_help() {
        let help = mount_help("usage");
        let terms = section("OPTIONS")
            .lines()
            .zip(section("OPTIONS").lines().skip(1))
            .filter(|(tp, _)| *tp == ".TP")
            .map(|(_, term)| text_of(term).replace('\u{1}', ""))
            .collect::<Vec<_>>();
        assert!(terms.len() > 30, "{terms:?}");
        for t in &terms {
            assert!(help.contains(t.trim()), "{t} missing from --help");
        }
        for raw in ["\\-", "\\f", ".B ", ".TP", "\u{1}"] {
            assert!(!help.contains(raw), "roff left in the help: {raw:?}");
        }
    }

    #[test]
    fn every_command_has_its_entry() {
        for (cmd, usage) in COMMANDS {
            let help = command_help(cmd).unwrap();
            assert!(help.starts_with(usage), "{cmd}");
            assert!(help.lines().count() > 3, "{cmd}: {help}");
            assert!(
                !help.contains(".TP") && !help.contains("\\-"),
                "{cmd}: {help}"
            );
        }
        let export = command_help("export").unwrap();
        assert!(
            export.contains("--gzip") && export.contains("--quiet"),
            "{export}"
        );
        assert!(command_help("nothing").is_none());
    }
}
