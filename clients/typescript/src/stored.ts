/**
 * An HTTP answer as `oncegate proxy` stores it (crates/oncegate-proxy/src/stored.rs): format
 * byte 1, the status (2 bytes), the header count (2 bytes), each header as a 2-byte name
 * length, the name, a 4-byte value length and the value, then the body; big-endian.
 */

/** A stored answer. */
export interface StoredAnswer {
  status: number;
  /** `[name, value]` pairs, names lowercase, in order. */
  headers: Array<[string, string]>;
  body: Buffer;
}

const FORMAT = 1;

/** The bytes stored with the key. */
export function encodeStored(answer: StoredAnswer): Buffer {
  const parts: Buffer[] = [];
  const head = Buffer.alloc(5);
  head.writeUInt8(FORMAT, 0);
  head.writeUInt16BE(answer.status, 1);
  head.writeUInt16BE(answer.headers.length, 3);
  parts.push(head);
  for (const [name, value] of answer.headers) {
    const n = Buffer.from(name, 'latin1');
    const v = Buffer.from(value, 'latin1');
    const nameLen = Buffer.alloc(2);
    nameLen.writeUInt16BE(n.length);
    const valueLen = Buffer.alloc(4);
    valueLen.writeUInt32BE(v.length);
    parts.push(nameLen, n, valueLen, v);
  }
  parts.push(answer.body);
  return Buffer.concat(parts);
}

/** Reads stored bytes back; `undefined` for bytes in another format. */
export function decodeStored(bytes: Uint8Array): StoredAnswer | undefined {
  const buf = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let at = 0;
  const take = (n: number): Buffer | undefined => {
    if (buf.length - at < n) return undefined;
    const out = buf.subarray(at, at + n);
    at += n;
    return out;
  };
  if (take(1)?.readUInt8(0) !== FORMAT) return undefined;
  const status = take(2)?.readUInt16BE(0);
  const count = take(2)?.readUInt16BE(0);
  if (status === undefined || count === undefined || status < 100 || status > 999) return undefined;
  const headers: Array<[string, string]> = [];
  for (let i = 0; i < count; i += 1) {
    const nameLen = take(2)?.readUInt16BE(0);
    const name = nameLen === undefined ? undefined : take(nameLen);
    const valueLen = take(4)?.readUInt32BE(0);
    const value = valueLen === undefined ? undefined : take(valueLen);
    if (name === undefined || value === undefined) return undefined;
    headers.push([name.toString('latin1'), value.toString('latin1')]);
  }
  return { status, headers, body: Buffer.from(buf.subarray(at)) };
}
