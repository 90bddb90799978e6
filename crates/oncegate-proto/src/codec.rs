//! The codec of the generated service: prost's, except that a request that does not
//! decode (invalid UTF-8 in a string field, a truncated message) is refused with
//! `INVALID_ARGUMENT` naming the field, like every other bad input, instead of tonic's
//! `INTERNAL`.

use std::marker::PhantomData;

use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::ProstCodec;

/// `tonic_prost::ProstCodec` with decode errors mapped to `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct StrictCodec<T, U> {
    inner: ProstCodec<T, U>,
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for StrictCodec<T, U> {
    fn default() -> Self {
        StrictCodec { inner: ProstCodec::default(), _types: PhantomData }
    }
}

impl<T, U> Codec for StrictCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as Codec>::Encoder;
    type Decoder = StrictDecoder<<ProstCodec<T, U> as Codec>::Decoder>;

    fn encoder(&mut self) -> Self::Encoder {
        self.inner.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        StrictDecoder(self.inner.decoder())
    }
}

/// The decoder half of [`StrictCodec`].
#[derive(Debug)]
pub struct StrictDecoder<D>(D);

impl<D: Decoder<Error = Status>> Decoder for StrictDecoder<D> {
    type Item = D::Item;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        self.0.decode(buf).map_err(refuse)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// prost reports `Message.field: reason`; the field is what the caller must fix.
fn refuse(status: Status) -> Status {
    let message = status.message();
    let detail = message.strip_prefix("failed to decode Protobuf message: ").unwrap_or(message);
    let field = detail
        .split(": ")
        .next()
        .and_then(|path| path.rsplit_once('.'))
        .map(|(_, field)| field.to_owned())
        .filter(|f| {
            !f.is_empty() && f.chars().all(|c| c.is_ascii_lowercase() || c == '_' || c.is_ascii_digit())
        });
    let text = match &field {
        Some(field) => format!("{field} could not be decoded: {detail}"),
        None => format!("the request could not be decoded: {detail}"),
    };
    crate::status::invalid_field(field.as_deref(), text)
}
