//! containerd's filter syntax, as `ctr snapshots ls` and the garbage collector send it to List:
//! each filter is selectors joined by `,` (all must hold), and a snapshot is listed when any
//! filter holds (no filter: all are listed). A selector is a field path — `name`, `parent`,
//! `kind`, `labels.KEY` (KEY quoted when it has dots: `labels."containerd.io/gc.root"`) —
//! alone (the field is present and not empty) or followed by `==`, `!=` or `~=` (a regular
//! expression) and a value, bare or in double quotes.

use std::collections::HashMap;

use crate::error::SnapError;

enum Op {
    Present,
    Equal(String),
    NotEqual(String),
    Matches(regex_lite::Regex),
}

struct Selector {
    path: Vec<String>,
    op: Op,
}

/// One filter: selectors that must all hold.
pub struct Filter(Vec<Selector>);

/// The fields a selector can look at.
pub struct Fields<'a> {
    pub name: &'a str,
    pub parent: &'a str,
    pub kind: &'a str,
    pub labels: &'a HashMap<String, String>,
}

impl Filter {
    pub fn parse(text: &str) -> Result<Filter, SnapError> {
        let bad = |why: &str| SnapError::InvalidArgument(format!("filter {text:?}: {why}"));
        let mut selectors = Vec::new();
        let mut rest = text.trim();
        while !rest.is_empty() {
            let mut path = Vec::new();
            loop {
                let (field, after) = if rest.starts_with('"') {
                    quoted(rest).ok_or_else(|| bad("a quoted field has no closing quote"))?
                } else {
                    let end = rest
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .unwrap_or(rest.len());
                    if end == 0 {
                        return Err(bad(
                            "expected a field name (name, parent, kind or labels.KEY)",
                        ));
                    }
                    (rest[..end].to_string(), &rest[end..])
                };
                path.push(field);
                rest = after.trim_start();
                match rest.strip_prefix('.') {
                    Some(after) => rest = after,
                    None => break,
                }
            }
            let op_text = ["==", "!=", "~="]
                .into_iter()
                .find(|op| rest.starts_with(op));
            let op = match op_text {
                None => Op::Present,
                Some(op) => {
                    rest = rest[2..].trim_start();
                    let (value, after) = if rest.starts_with('"') {
                        quoted(rest).ok_or_else(|| bad("a quoted value has no closing quote"))?
                    } else {
                        let end = rest.find(',').unwrap_or(rest.len());
                        (rest[..end].trim_end().to_string(), &rest[end..])
                    };
                    rest = after.trim_start();
                    match op {
                        "==" => Op::Equal(value),
                        "!=" => Op::NotEqual(value),
                        _ => Op::Matches(
                            regex_lite::Regex::new(&value)
                                .map_err(|e| bad(&format!("bad regular expression: {e}")))?,
                        ),
                    }
                }
            };
            selectors.push(Selector { path, op });
            match rest.strip_prefix(',') {
                Some(after) => rest = after.trim_start(),
                None if rest.is_empty() => {}
                None => {
                    return Err(bad(&format!(
                        "unexpected {rest:?}: selectors are joined by ','"
                    )));
                }
            }
        }
        Ok(Filter(selectors))
    }

    pub fn matches(&self, fields: &Fields) -> bool {
        self.0.iter().all(|s| {
            let value = match s.path.as_slice() {
                [f] if f == "name" => Some(fields.name),
                [f] if f == "parent" => Some(fields.parent),
                [f] if f == "kind" => Some(fields.kind),
                [f, key] if f == "labels" => fields.labels.get(key).map(String::as_str),
                // containerd lets a label key with dots go unquoted: labels.a.b.c
                [f, rest @ ..] if f == "labels" && !rest.is_empty() => {
                    fields.labels.get(&rest.join(".")).map(String::as_str)
                }
                _ => None,
            };
            match (&s.op, value) {
                (Op::Present, v) => v.is_some_and(|v| !v.is_empty()),
                (Op::Equal(want), v) => v == Some(want.as_str()),
                (Op::NotEqual(want), v) => v != Some(want.as_str()),
                (Op::Matches(re), v) => v.is_some_and(|v| re.is_match(v)),
            }
        })
    }
}

/// A double-quoted string at the start of `s` (backslash escapes the next character): the
/// string and what follows it.
fn quoted(s: &str) -> Option<(String, &str)> {
    let mut out = String::new();
    let mut chars = s.char_indices().skip(1);
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, &s[i + 1..])),
            '\\' => out.push(chars.next()?.1),
            c => out.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields<'a>(labels: &'a HashMap<String, String>) -> Fields<'a> {
        Fields {
            name: "a-wl",
            parent: "p-wl",
            kind: "active",
            labels,
        }
    }

    #[test]
    fn selectors_joined_by_commas_must_all_hold() {
        let labels = HashMap::from([(
            "containerd.io/gc.root".to_string(),
            "check-walk".to_string(),
        )]);
        let f =
            Filter::parse(r#"kind==active,labels."containerd.io/gc.root"==check-walk"#).unwrap();
        assert!(f.matches(&fields(&labels)));
        let f = Filter::parse(r#"kind==view,labels."containerd.io/gc.root"==check-walk"#).unwrap();
        assert!(!f.matches(&fields(&labels)));
    }

    #[test]
    fn presence_inequality_and_regular_expressions() {
        let labels = HashMap::from([("l".to_string(), "2".to_string())]);
        assert!(Filter::parse("labels.l").unwrap().matches(&fields(&labels)));
        assert!(!Filter::parse("labels.m").unwrap().matches(&fields(&labels)));
        assert!(
            Filter::parse("labels.m!=1")
                .unwrap()
                .matches(&fields(&labels))
        );
        assert!(
            Filter::parse(r#"name~="^a-""#)
                .unwrap()
                .matches(&fields(&labels))
        );
        assert!(
            !Filter::parse("parent~=^x")
                .unwrap()
                .matches(&fields(&labels))
        );
        assert!(
            Filter::parse("parent == \"p-wl\"")
                .unwrap()
                .matches(&fields(&labels))
        );
    }

    #[test]
    fn malformed_filters_are_refused_with_the_reason() {
        for bad in [
            "==x",
            r#"labels."open"#,
            "name==\"x",
            "name~=(",
            "name==a,,",
        ] {
            let err = Filter::parse(bad)
                .err()
                .unwrap_or_else(|| panic!("{bad} parsed"));
            assert!(matches!(err, SnapError::InvalidArgument(_)), "{bad}: {err}");
        }
    }
}
