/** Test helpers: a real `oncegate serve` per test file, on a free port with its own data directory. */
import { spawn } from 'node:child_process';
import type { ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import * as readline from 'node:readline';

/** The package's root (build-test/test/ is two levels below it once compiled). */
export const PACKAGE_ROOT = path.resolve(__dirname, '..', '..');
/** The repository's root. */
export const REPO_ROOT = path.resolve(PACKAGE_ROOT, '..', '..');

/** The server binary: ONCEGATE_BIN, else target/release, else target/debug. */
export function serverBinary(): string {
  const candidates = [
    process.env['ONCEGATE_BIN'],
    path.join(REPO_ROOT, 'target', 'release', 'oncegate'),
    path.join(REPO_ROOT, 'target', 'debug', 'oncegate'),
  ].filter((c): c is string => c !== undefined && c !== '');
  const found = candidates.find((c) => fs.existsSync(c));
  if (found === undefined) throw new Error(`no oncegate binary: set ONCEGATE_BIN (looked at ${candidates.join(', ')})`);
  return found;
}

/** A running server. */
export interface Server {
  /** `http://127.0.0.1:PORT` (or `https://` with TLS). */
  address: string;
  /** The temporary directory holding its data (and anything the test wrote there). */
  dir: string;
  /** SIGTERM, then waits for the exit; removes the directory. */
  stop(): Promise<void>;
  /** SIGKILL (no shutdown runs), then waits for the exit; keeps the directory, so a server started on it again finds the data. */
  kill(): Promise<void>;
}

/**
 * Starts `oncegate serve --listen 127.0.0.1:0` (or `listen`: a restarted server takes its
 * address back) and waits for its "listening" log line.
 */
export async function startServer(options: { config?: string; tls?: boolean; dir?: string; listen?: string } = {}): Promise<Server> {
  const dir = options.dir ?? fs.mkdtempSync(path.join(os.tmpdir(), 'oncegate-ts-'));
  const args = ['serve', '--listen', options.listen ?? '127.0.0.1:0', '--metrics-listen', '127.0.0.1:0', '--data-dir', path.join(dir, 'data')];
  if (options.config !== undefined) {
    const file = path.join(dir, 'oncegate.toml');
    fs.writeFileSync(file, options.config);
    args.push('--config', file);
  }
  const env: NodeJS.ProcessEnv = { ...process.env, ONCEGATE_LOG_FORMAT: 'text' };
  delete env['RUST_LOG'];
  delete env['ONCEGATE_CONFIG'];
  const child: ChildProcess = spawn(serverBinary(), args, { env, stdio: ['ignore', 'ignore', 'pipe'] });
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  const addr = await new Promise<string>((resolve, reject) => {
    const lines = readline.createInterface({ input: child.stderr as NodeJS.ReadableStream });
    const log: string[] = [];
    // Keep draining the log after the address is found, so the pipe never fills.
    lines.on('line', (line) => {
      if (log.length < 200) log.push(line);
      const found = /listening addr=(\S+)/.exec(line);
      if (found?.[1] !== undefined) resolve(found[1]);
    });
    child.once('exit', (code) => reject(new Error(`the server exited (${code}) before listening:\n${log.join('\n')}`)));
    child.once('error', reject);
  });
  return {
    address: `${options.tls ? 'https' : 'http'}://${addr}`,
    dir,
    async stop(): Promise<void> {
      child.kill('SIGTERM');
      await exited;
      fs.rmSync(dir, { recursive: true, force: true });
    },
    async kill(): Promise<void> {
      child.kill('SIGKILL');
      await exited;
    },
  };
}

/** Runs a command, returning whether it exited 0. */
export function run(command: string, args: string[], cwd: string): Promise<boolean> {
  return new Promise((resolve) => {
    const child = spawn(command, args, { cwd, stdio: 'ignore' });
    child.once('error', () => resolve(false));
    child.once('exit', (code) => resolve(code === 0));
  });
}

/** A fresh key for a test. */
export function uniqueKey(name: string): string {
  return `${name}-${process.pid}-${Math.random().toString(36).slice(2)}`;
}
