#!/usr/bin/env node
// Builds the package: copies the repository's proto into ./proto (so an installed package
// finds it at run time), generates typed stubs into src/gen with proto-loader-gen-types
// (no protoc binary), and compiles src/ into dist/ with tsc. Run by `npm run build` and by
// the `prepare` script, so `npm install ./clients/typescript` yields a usable package.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { execFileSync } = require('node:child_process');

const root = path.resolve(__dirname, '..');
const repoProto = path.resolve(root, '..', '..', 'crates', 'oncegate-proto', 'proto');
const protoDir = path.join(root, 'proto');
const files = ['oncegate/v1/gate.proto', 'oncegate/v1/admin.proto'];

/** Copies the proto files from the repository, when the package sits in it. */
function copyProto() {
  if (!fs.existsSync(repoProto)) {
    if (files.every((f) => fs.existsSync(path.join(protoDir, f)))) return; // a packed copy
    throw new Error(`cannot find the proto at ${repoProto}`);
  }
  for (const file of files) {
    const to = path.join(protoDir, file);
    fs.mkdirSync(path.dirname(to), { recursive: true });
    fs.copyFileSync(path.join(repoProto, file), to);
  }
}

/** Resolves a package's file through Node's resolution (hoisted or not). */
function resolveBin(pkg, file) {
  const manifest = require.resolve(`${pkg}/package.json`, { paths: [root] });
  return path.join(path.dirname(manifest), file);
}

function generate() {
  const out = path.join(root, 'src', 'gen');
  fs.rmSync(out, { recursive: true, force: true });
  // These options must match the loader's in src/proto.ts.
  execFileSync(process.execPath, [
    resolveBin('@grpc/proto-loader', 'build/bin/proto-loader-gen-types.js'),
    '--keepCase', '--longs=String', '--enums=String', '--defaults', '--oneofs',
    '--grpcLib=@grpc/grpc-js', '-I', protoDir, '-O', out, ...files,
  ], { stdio: 'inherit', cwd: root });
}

function compile() {
  fs.rmSync(path.join(root, 'dist'), { recursive: true, force: true });
  execFileSync(process.execPath, [resolveBin('typescript', 'bin/tsc'), '-p', path.join(root, 'tsconfig.json')], {
    stdio: 'inherit',
    cwd: root,
  });
}

/**
 * Installs the build's tools (the devDependencies) when they cannot be found: `npm install
 * ./clients/typescript` links the folder and runs `prepare` there before (or without)
 * installing its devDependencies, as npm does for a git dependency.
 */
function ensureTools() {
  const missing = ['typescript', '@grpc/proto-loader', '@grpc/grpc-js'].filter((pkg) => {
    try {
      require.resolve(`${pkg}/package.json`, { paths: [root] });
      return false;
    } catch {
      return true;
    }
  });
  if (missing.length === 0) return;
  console.error(`oncegate: installing the build's tools (${missing.join(', ')} missing)`);
  const npmCli = process.env.npm_execpath;
  const [command, prefix] = npmCli && npmCli.endsWith('.js') ? [process.execPath, [npmCli]] : ['npm', []];
  const env = { ...process.env };
  for (const name of Object.keys(env)) {
    // The outer install's settings (its prefix, its global flag) are not this one's.
    if (name.toLowerCase().startsWith('npm_config_')) delete env[name];
  }
  execFileSync(command, [...prefix, 'install', '--ignore-scripts', '--include=dev', '--no-audit', '--no-fund', '--no-save'], {
    cwd: root,
    stdio: ['ignore', 'inherit', 'inherit'],
    env,
  });
}

ensureTools();
copyProto();
generate();
compile();
