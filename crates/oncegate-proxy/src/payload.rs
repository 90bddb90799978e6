//! The canonical form of a JSON body for its fingerprint: the text as written, except
//! that spacing and the order of an object's members do not count.
//!
//! Members are sorted by their decoded names (a stable sort, so a repeated member keeps
//! its place among its namesakes), and every string and number stays exactly as written.
//! Parsing into a value would lose what an upstream may still tell apart (digits past a
//! double's precision, a member given twice); keeping the scalars in their places keeps
//! which member each one belongs to, so two payloads that differ only in where their
//! values stand never share a fingerprint.

/// Nesting deeper than this has no canonical form here (serde_json's parser stops at the
/// same depth): the walk recurses once per level, and copies each object's members once
/// more per level, so the depth bounds both the stack and the copying.
const DEPTH_MAX: usize = 128;

/// The canonical form of `json`, a document already known to be valid JSON (the caller
/// has parsed it into a value, which bounds its depth too); `None` past [`DEPTH_MAX`]
/// levels. On text that is not JSON the result is some string, never a hang or a panic.
pub(crate) fn canonical_as_written(json: &str) -> Option<String> {
    let mut walker = Walker { text: json, at: 0, depth: 0, too_deep: false };
    let mut out = String::with_capacity(json.len());
    walker.value(&mut out);
    (!walker.too_deep).then_some(out)
}

struct Walker<'a> {
    text: &'a str,
    at: usize,
    depth: usize,
    /// Set when the walk stopped at [`DEPTH_MAX`].
    too_deep: bool,
}

impl Walker<'_> {
    /// The byte at the cursor; `\0` at the end (valid JSON has none outside strings).
    fn peek(&self) -> u8 {
        self.text.as_bytes().get(self.at).copied().unwrap_or(b'\0')
    }

    fn at_end(&self) -> bool {
        self.at >= self.text.len()
    }

    fn skip_space(&mut self) {
        while matches!(self.peek(), b' ' | b'\t' | b'\n' | b'\r') {
            self.at += 1;
        }
    }

    /// Writes the value at the cursor and moves past it.
    fn value(&mut self, out: &mut String) {
        self.skip_space();
        match self.peek() {
            b'{' | b'[' if self.depth == DEPTH_MAX => {
                self.too_deep = true;
                self.at = self.text.len();
            }
            b'{' => self.nested(out, Self::object),
            b'[' => self.nested(out, Self::array),
            b'"' => {
                let string = self.string();
                out.push_str(string);
            }
            _ => {
                // A number, `true`, `false` or `null`: up to the next delimiter.
                let start = self.at;
                while !self.at_end()
                    && !matches!(self.peek(), b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r')
                {
                    self.at += 1;
                }
                // Only text that is not JSON stops here at once; the walk still moves on.
                if self.at == start {
                    self.at += 1;
                }
                out.push_str(self.text.get(start..self.at).unwrap_or_default());
            }
        }
    }

    fn nested(&mut self, out: &mut String, walk: fn(&mut Self, &mut String)) {
        self.depth += 1;
        walk(self, out);
        self.depth -= 1;
    }

    /// Past the spaces and the comma after an element or a member.
    fn skip_separator(&mut self) {
        self.skip_space();
        if self.peek() == b',' {
            self.at += 1;
        }
        self.skip_space();
    }

    /// The string at the cursor as written, quotes included.
    fn string(&mut self) -> &str {
        let start = self.at;
        self.at += 1;
        while !self.at_end() && self.peek() != b'"' {
            self.at += if self.peek() == b'\\' { 2 } else { 1 };
        }
        self.at = (self.at + 1).min(self.text.len());
        self.text.get(start..self.at).unwrap_or_default()
    }

    fn array(&mut self, out: &mut String) {
        self.at += 1;
        out.push('[');
        self.skip_space();
        let mut first = true;
        while !self.at_end() && self.peek() != b']' {
            if !first {
                out.push(',');
            }
            first = false;
            self.value(out);
            self.skip_separator();
        }
        self.at = (self.at + 1).min(self.text.len());
        out.push(']');
    }

    fn object(&mut self, out: &mut String) {
        self.at += 1;
        // (the decoded name, the member as written: `"name":value`)
        let mut members: Vec<(String, String)> = Vec::new();
        self.skip_space();
        while !self.at_end() && self.peek() != b'}' {
            let name = self.string();
            let decoded = serde_json::from_str::<String>(name).unwrap_or_else(|_| name.to_owned());
            let mut member = String::from(name);
            member.push(':');
            self.skip_space();
            self.at = (self.at + 1).min(self.text.len()); // the colon
            self.value(&mut member);
            members.push((decoded, member));
            self.skip_separator();
        }
        self.at = (self.at + 1).min(self.text.len());
        members.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        out.push('{');
        for (i, (_, member)) in members.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(member);
        }
        out.push('}');
    }
}

#[cfg(test)]
mod tests {
    use super::{DEPTH_MAX, canonical_as_written};

    fn canonical(json: &str) -> String {
        canonical_as_written(json).expect("within the depth limit")
    }

    #[test]
    fn spacing_and_member_order_do_not_count_and_scalars_stay_as_written() {
        assert_eq!(
            canonical(" { \"b\" : -1.50e3 ,\n\"a\": [ \"x\\\"y\" , true, null, {} , [] ] } "),
            r#"{"a":["x\"y",true,null,{},[]],"b":-1.50e3}"#
        );
        assert_eq!(canonical(r#"{"b":{"d":1,"c":2},"a":0}"#), canonical(r#"{"a":0,"b":{"c":2,"d":1}}"#));
        assert_eq!(canonical("\"only\""), "\"only\"");
        assert_eq!(canonical(" 12 "), "12");
    }

    #[test]
    fn values_keep_their_members() {
        // Both parse to {"from": 1e20, "to": 1e20}, and their numbers sorted are the same:
        // only where each number stands tells them apart.
        assert_ne!(
            canonical(r#"{"from":100000000000000000001,"to":100000000000000000002}"#),
            canonical(r#"{"from":100000000000000000002,"to":100000000000000000001}"#)
        );
        assert_ne!(
            canonical(r#"{"x":{"q":1,"q":2},"y":{"q":2}}"#),
            canonical(r#"{"x":{"q":2},"y":{"q":1,"q":2}}"#)
        );
        // A repeated member keeps its place among its namesakes: most parsers keep the last.
        assert_ne!(canonical(r#"{"q":1,"q":2}"#), canonical(r#"{"q":2,"q":1}"#));
        assert_ne!(canonical(r#"{"q":10000000000000000001}"#), canonical(r#"{"q":10000000000000000000}"#));
        assert_ne!(canonical(r#"[1,2]"#), canonical(r#"[2,1]"#));
    }

    #[test]
    fn text_that_is_not_json_ends_the_walk() {
        for text in
            ["{\"a\":", "[1,", "\"open", "{\"a\" 1", "", "{", "[", "\"\\", "[}", "[]]", "{1:2}", "[\u{e9}]"]
        {
            let _ = canonical_as_written(text);
        }
    }

    #[test]
    fn nesting_past_the_depth_limit_has_no_canonical_form() {
        let at_limit = format!("{}{}", "[".repeat(DEPTH_MAX), "]".repeat(DEPTH_MAX));
        assert_eq!(canonical(&at_limit), at_limit);
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(canonical_as_written(&deep), None);
        let objects = format!("{}1{}", r#"{"a":"#.repeat(100_000), "}".repeat(100_000));
        assert_eq!(canonical_as_written(&objects), None);
    }

    #[test]
    fn names_sort_by_what_they_decode_to() {
        assert_eq!(canonical(r#"{"b":1,"\u0061":2}"#), r#"{"\u0061":2,"b":1}"#);
    }
}
