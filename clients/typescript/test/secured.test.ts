/** The client against a server as a network deployment runs it: mutual TLS and a tenant's bearer token. */
import { test } from 'node:test';
import * as assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, GateError, OnceError, once } from '../src/index';
import { run, startServer, uniqueKey } from './helpers';

/** A CA, a server certificate for localhost and 127.0.0.1, and a client certificate, made with the openssl CLI. */
async function makePki(dir: string): Promise<boolean> {
  const ext = path.join(dir, 'ext.cnf');
  fs.writeFileSync(
    ext,
    [
      '[ca]',
      'basicConstraints = critical, CA:TRUE',
      'keyUsage = critical, keyCertSign, cRLSign',
      '[server]',
      'basicConstraints = CA:FALSE',
      'subjectAltName = DNS:localhost, IP:127.0.0.1',
      'extendedKeyUsage = serverAuth',
      'keyUsage = critical, digitalSignature',
      '[client]',
      'basicConstraints = CA:FALSE',
      'subjectAltName = DNS:client.test',
      'extendedKeyUsage = clientAuth',
      'keyUsage = critical, digitalSignature',
      '',
    ].join('\n'),
  );
  const ok = (args: string[]): Promise<boolean> => run('openssl', args, dir);
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes'];
  if (!(await ok(['req', '-x509', ...ec, '-keyout', 'ca.key', '-out', 'ca.crt', '-days', '2', '-subj', '/CN=oncegate test CA', '-extensions', 'ca', '-config', ext]))) {
    return false;
  }
  for (const name of ['server', 'client']) {
    if (!(await ok(['req', ...ec, '-keyout', `${name}.key`, '-out', `${name}.csr`, '-subj', `/CN=oncegate ${name}`]))) return false;
    const sign = ['x509', '-req', '-in', `${name}.csr`, '-CA', 'ca.crt', '-CAkey', 'ca.key', '-CAcreateserial', '-out', `${name}.crt`, '-days', '2'];
    if (!(await ok([...sign, '-extfile', ext, '-extensions', name]))) return false;
  }
  return true;
}

test('the client speaks mutual TLS with a token and hears refusals by code', async (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'oncegate-ts-tls-'));
  if (!(await makePki(dir))) {
    fs.rmSync(dir, { recursive: true, force: true });
    t.skip('the openssl CLI is not available to make certificates');
    return;
  }
  const tokenSha256 = createHash('sha256').update('acme-secret').digest('hex');
  const config = [
    '[server]',
    `tls_cert_path = ${JSON.stringify(path.join(dir, 'server.crt'))}`,
    `tls_key_path = ${JSON.stringify(path.join(dir, 'server.key'))}`,
    `tls_client_ca_path = ${JSON.stringify(path.join(dir, 'ca.crt'))}`,
    '',
    '[[tenants]]',
    'name = "acme"',
    `token_sha256 = "${tokenSha256}"`,
    '',
  ].join('\n');
  const server = await startServer({ dir, config, tls: true });
  const tls = { caFile: path.join(dir, 'ca.crt'), certFile: path.join(dir, 'client.crt'), keyFile: path.join(dir, 'client.key') };
  const withToken = new Client({ address: server.address, token: 'acme-secret', tls });
  const anonymous = new Client({ address: server.address, tls, retry: { attemptsMax: 1 } });
  const noCertificate = new Client({ address: server.address, token: 'acme-secret', tls: { caFile: tls.caFile }, retry: { attemptsMax: 1 }, timeoutMs: 3_000 });
  try {
    assert.ok(server.address.startsWith('https://'));
    const ran = await once(withToken, { namespace: 'live', key: uniqueKey('tls') }, () => 'ok');
    assert.equal(ran.response.toString(), 'ok');
    const refused = await once(anonymous, { namespace: 'live', key: uniqueKey('anon') }, () => 'no').then(
      () => assert.fail('a call without the token was served'),
      (error: unknown) => error,
    );
    assert.ok(refused instanceof GateError, String(refused));
    assert.ok(!(refused instanceof OnceError));
    assert.equal(refused.code, 'unauthenticated');
    assert.equal(refused.retryable, false);
    // Without a client certificate the handshake fails: no answer.
    await assert.rejects(noCertificate.get({ namespace: 'live', key: 'k' }), (error: unknown) => error instanceof GateError && error.code === 'unavailable');
  } finally {
    withToken.close();
    anonymous.close();
    noCertificate.close();
    await server.stop();
  }
});
