//! An upstream answer as the gate stores it, and back: format byte 1, the status (2 bytes),
//! the header count (2 bytes), each header as a 2-byte name length, the name, a 4-byte
//! value length and the value, then the body. Big-endian; a replay is the same bytes the
//! first caller got, headers and body.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const FORMAT: u8 = 1;

/// A response the proxy stored or will store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The upstream's status.
    pub status: StatusCode,
    /// The headers kept (those the configuration names).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

impl Stored {
    /// The bytes stored with the key.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.body.len());
        out.push(FORMAT);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        out.extend_from_slice(&(self.headers.len() as u16).to_be_bytes());
        for (name, value) in &self.headers {
            out.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(&(value.as_bytes().len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&self.body);
        out
    }

    /// Reads stored bytes back; `None` for bytes this version did not write.
    pub fn decode(bytes: &[u8]) -> Option<Stored> {
        let mut at = Reader(bytes);
        if at.take(1)? != [FORMAT] {
            return None;
        }
        let status = StatusCode::from_u16(u16::from_be_bytes(at.take(2)?.try_into().ok()?)).ok()?;
        let count = u16::from_be_bytes(at.take(2)?.try_into().ok()?);
        let mut headers = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let name_len = u16::from_be_bytes(at.take(2)?.try_into().ok()?);
            let name = HeaderName::from_bytes(at.take(usize::from(name_len))?).ok()?;
            let value_len = u32::from_be_bytes(at.take(4)?.try_into().ok()?);
            let value = HeaderValue::from_bytes(at.take(usize::try_from(value_len).ok()?)?).ok()?;
            headers.push((name, value));
        }
        Some(Stored { status, headers, body: at.0.to_vec() })
    }

    /// The headers as a map, for a response.
    pub fn header_map(&self) -> HeaderMap {
        self.headers.iter().cloned().collect()
    }
}

/// The unread rest of stored bytes.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_answer_reads_back_byte_for_byte() {
        let stored = Stored {
            status: StatusCode::CREATED,
            headers: vec![
                (HeaderName::from_static("content-type"), HeaderValue::from_static("application/json")),
                (HeaderName::from_static("location"), HeaderValue::from_static("/orders/77")),
            ],
            body: b"{\"order\":\"A-77\"}\x00\xff".to_vec(),
        };
        assert_eq!(Stored::decode(&stored.encode()), Some(stored.clone()));
        assert_eq!(Stored::decode(&stored.encode()[..5]), None, "cut short");
        assert_eq!(Stored::decode(b"\x02rest"), None, "another format");
    }
}
