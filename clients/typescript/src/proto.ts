/**
 * The `oncegate.v1` service definitions, loaded at run time from the proto files copied
 * into the package (./proto), typed by the stubs generated into src/gen at build time.
 */
import * as fs from 'node:fs';
import * as path from 'node:path';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import type { ProtoGrpcType } from './gen/gate';

export type { GateClient } from './gen/oncegate/v1/Gate';
export type { ReserveRequest } from './gen/oncegate/v1/ReserveRequest';
export type { ReserveResponse__Output as ReserveResponse } from './gen/oncegate/v1/ReserveResponse';
export type { CommitRequest } from './gen/oncegate/v1/CommitRequest';
export type { CommitResponse__Output as CommitResponse } from './gen/oncegate/v1/CommitResponse';
export type { ReleaseRequest } from './gen/oncegate/v1/ReleaseRequest';
export type { ReleaseResponse__Output as ReleaseResponse } from './gen/oncegate/v1/ReleaseResponse';
export type { HeartbeatRequest } from './gen/oncegate/v1/HeartbeatRequest';
export type { HeartbeatResponse__Output as HeartbeatResponse } from './gen/oncegate/v1/HeartbeatResponse';
export type { GetRequest } from './gen/oncegate/v1/GetRequest';
export type { GetResponse__Output as GetResponse } from './gen/oncegate/v1/GetResponse';
export type { SessionRequest } from './gen/oncegate/v1/SessionRequest';
export type { SessionResponse__Output as SessionResponse } from './gen/oncegate/v1/SessionResponse';
export type { Refusal__Output as Refusal } from './gen/oncegate/v1/Refusal';

/** The directory holding `oncegate/v1/gate.proto` inside the installed package (`<package>/proto`, beside `dist`). */
export const PROTO_DIR = findProtoDir();

function findProtoDir(): string {
  // dist/proto.js in the package; build-test/src/proto.js when the tests run.
  for (const up of [['..'], ['..', '..']]) {
    const dir = path.resolve(__dirname, ...up, 'proto');
    if (fs.existsSync(path.join(dir, 'oncegate', 'v1', 'gate.proto'))) return dir;
  }
  return path.resolve(__dirname, '..', 'proto');
}

/** The loader's options; scripts/build.js generates the types with the same ones. */
export const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_DIR],
};

let loaded: ProtoGrpcType | undefined;

/** The loaded `oncegate.v1` package (loaded once). */
export function protoPackage(): ProtoGrpcType {
  if (loaded === undefined) {
    const definition = protoLoader.loadSync('oncegate/v1/gate.proto', LOADER_OPTIONS);
    loaded = grpc.loadPackageDefinition(definition) as unknown as ProtoGrpcType;
  }
  return loaded;
}
