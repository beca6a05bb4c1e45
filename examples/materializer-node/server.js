#!/usr/bin/env node
'use strict';
// omni_serving.v1.MaterializerService in Node.js, written from the contract
// documents (protos/omni_serving/v1/*.proto, docs/writing-a-materializer.md).
//
//   node server.js --listen unix:///run/omni/m.sock --deployment NAME
//
// See README.md for the options and what is implemented.

const fs = require('fs');
const path = require('path');
const crypto = require('crypto');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const { Code, StepFail, collectReleases, buildStep, INTER_STAGE, CLIENT, SEL_ALL, SEL_LAST } = require('./materialize');
const { Arena, ArenaError, regionNameOk } = require('./arena');

const PKG = require('./package.json');
const CONTRACT = 'omni_serving.v1';
const CONTRACT_VERSION = 2;
const SERVICE_NAME = 'omni_serving.v1.MaterializerService';

// ---------------------------------------------------------------------------
// Command line

const USAGE = `usage: node server.js --listen ADDRESS (--deployment NAME | --shm-prefix PREFIX)
                      [--readiness-timeout-ms MS] [--drain-grace-s S | --drain-grace-ms MS]
                      [--protos DIR] [--log-level debug|info|warning|error]

  --listen ADDRESS          unix:///abs/path.sock, unix:relative.sock, or host:port
  --deployment NAME         deployment served; accepts arena segments omni-NAME-arena-*
  --shm-prefix PREFIX       the same, given as the prefix itself (omni-NAME)
  --readiness-timeout-ms MS default wait for a slot's readiness mark when the
                            stream's open.readiness_timeout_ms is 0 (default 5000)
  --drain-grace-s S         on SIGTERM/SIGINT, how long open streams keep being
                            answered before they end with UNAVAILABLE (default 30)
  --drain-grace-ms MS       the same in milliseconds
  --protos DIR              directory holding omni_serving/v1/*.proto
                            (default: ../../protos next to this file)
  --log-level LEVEL         default info`;

function parseArgs(argv) {
  const opts = {
    listen: null,
    shmPrefix: null,
    readinessTimeoutMs: 5000,
    drainGraceMs: 30000,
    protos: path.resolve(__dirname, '..', '..', 'protos'),
    logLevel: 'info',
  };
  const need = (i, flag) => {
    if (i + 1 >= argv.length) usageError(`${flag} needs a value`);
    return argv[i + 1];
  };
  for (let i = 0; i < argv.length; i++) {
    let a = argv[i];
    let val;
    const eq = a.indexOf('=');
    if (a.startsWith('--') && eq > 0) {
      val = a.slice(eq + 1);
      a = a.slice(0, eq);
    }
    const take = () => (val !== undefined ? val : need(i++, a));
    switch (a) {
      case '-h':
      case '--help':
        process.stdout.write(USAGE + '\n');
        process.exit(0);
        break;
      case '--listen':
        opts.listen = take();
        break;
      case '--deployment':
        opts.shmPrefix = `omni-${take()}`;
        break;
      case '--shm-prefix':
        opts.shmPrefix = take();
        break;
      case '--readiness-timeout-ms':
        opts.readinessTimeoutMs = intArg(a, take());
        break;
      case '--drain-grace-ms':
        opts.drainGraceMs = intArg(a, take());
        break;
      case '--drain-grace-s':
        opts.drainGraceMs = intArg(a, take()) * 1000;
        break;
      case '--protos':
        opts.protos = path.resolve(take());
        break;
      case '--log-level':
        opts.logLevel = take().toLowerCase();
        break;
      default:
        usageError(`unknown argument ${argv[i]}`);
    }
  }
  if (!opts.listen) usageError('--listen is required');
  if (!opts.shmPrefix) usageError('--deployment (or --shm-prefix) is required');
  return opts;
}

function intArg(flag, v) {
  const n = Number(v);
  if (!Number.isInteger(n) || n < 0) usageError(`${flag}: ${v} is not a non-negative integer`);
  return n;
}

function usageError(msg) {
  process.stderr.write(`${USAGE}\nerror: ${msg}\n`);
  process.exit(2);
}

const opts = parseArgs(process.argv.slice(2));

const LEVELS = { debug: 10, info: 20, warning: 30, warn: 30, error: 40 };
const logThreshold = LEVELS[opts.logLevel] || 20;
function log(level, msg) {
  if ((LEVELS[level] || 20) < logThreshold) return;
  process.stderr.write(`${new Date().toISOString()} ${level.toUpperCase()} materializer-node: ${msg}\n`);
}

// ---------------------------------------------------------------------------
// Protos

const LOADER_OPTS = {
  keepCase: true, // field names as in the .proto files
  longs: String, // uint64/int64 as decimal strings (BigInt-parsed where compared)
  enums: Number, // enum values as numbers: unknown values survive decoding
  bytes: Buffer,
  defaults: false, // absent stays undefined: presence of messages/oneofs is visible
  arrays: true, // absent repeated fields decode as []
  oneofs: true, // virtual field naming the set member of each oneof
};

const omniDef = protoLoader.loadSync(['omni_serving/v1/materializer.proto'], {
  ...LOADER_OPTS,
  includeDirs: [opts.protos],
});
const healthDef = protoLoader.loadSync(['grpc/health/v1/health.proto'], {
  ...LOADER_OPTS,
  includeDirs: [path.join(__dirname, 'proto')],
});
const omni = grpc.loadPackageDefinition(omniDef).omni_serving.v1;
const health = grpc.loadPackageDefinition(healthDef).grpc.health.v1;

// ---------------------------------------------------------------------------
// Service state

const instanceId = crypto.randomUUID();
const startTimeMs = Date.now();
const counters = {
  stepsMaterialized: 0n,
  stepsFailed: 0n,
  streamsOpened: 0,
  streamsRefused: 0,
  streamsCancelled: 0,
  failuresByCode: {},
};
const streams = new Set(); // Materialize calls in progress
let draining = false;
let drainReason = '';
let drainDeadline = 0;
let server = null;

// ---------------------------------------------------------------------------
// Materialize

function validateOpen(open) {
  const prefix = open.shm_prefix || '';
  if (prefix !== '' && prefix !== opts.shmPrefix) {
    return {
      code: grpc.status.FAILED_PRECONDITION,
      details: `open.shm_prefix: stream is for deployment prefix '${prefix}', this materializer serves '${opts.shmPrefix}'`,
    };
  }
  // Stage by stage: its routes (source, key, destination, selection), then its id.
  const plans = new Map();
  const stages = open.stages || [];
  const bad = (details) => ({ code: grpc.status.INVALID_ARGUMENT, details });
  for (let s = 0; s < stages.length; s++) {
    const st = stages[s];
    const id = st.stage_id || 0;
    const routes = st.routes || [];
    for (let j = 0; j < routes.length; j++) {
      const r = routes[j];
      const w = `open.stages[${s}].routes[${j}]`;
      if (!r.source) return bad(`${w}.source: is empty`);
      if (!r.key) return bad(`${w}.key: is empty`);
      if (r.destination !== INTER_STAGE && r.destination !== CLIENT) {
        return bad(`${w}.destination: must be INTER_STAGE or CLIENT, got ${r.destination || 0}`);
      }
      if (r.selection !== SEL_ALL && r.selection !== SEL_LAST) {
        return bad(`${w}.selection: must be ALL or LAST, got ${r.selection || 0}`);
      }
    }
    if (plans.has(id)) return bad(`open.stages[${s}].stage_id: stage ${id} is declared twice`);
    plans.set(id, {
      stage_id: id,
      name: st.name || '',
      routes: routes.map((r) => ({ source: r.source, key: r.key, destination: r.destination, selection: r.selection })),
    });
  }
  return { plans };
}

function drainingMessage() {
  // grace_ms: what is left of the grace period.
  const left = Math.max(1, Math.round(drainDeadline - Date.now()));
  return { draining: { reason: drainReason, successor: '', grace_ms: left } };
}

class MaterializeStream {
  constructor(call) {
    this.call = call;
    this.opened = false;
    this.broken = false; // a protocol error was seen; further input is ignored
    this.done = false; // the call has ended (status sent or cancelled)
    this.cancelled = false;
    this.plans = null;
    this.lastStep = new Map(); // stage_id -> BigInt step id of the last admitted snapshot
    this.readinessTimeoutMs = opts.readinessTimeoutMs;
    this.contractVersion = 1;
    this.clientName = '';
    this.drainSent = false;
    this.closing = false; // a version-1 stream being wound up on drain
    this.queue = Promise.resolve(); // answers go out in arrival order
    this.peer = call.getPeer();

    call.on('data', (req) => this.onRequest(req));
    call.on('end', () => this.onHalfClose());
    call.on('cancelled', () => this.onCancel());
    call.on('error', () => {
      /* grpc-js turns emitted errors into the call status */
    });
  }

  enqueue(fn) {
    this.queue = this.queue.then(fn).catch((e) => {
      log('error', `stream ${this.clientName || this.peer}: ${e && e.stack ? e.stack : e}`);
      this.finish({ code: grpc.status.INTERNAL, details: String(e && e.message ? e.message : e) });
    });
  }

  /** Ends the call: status OK (no argument) or the given {code, details}. */
  finish(status) {
    if (this.done) return;
    this.done = true;
    streams.delete(this);
    if (status && status.code !== grpc.status.OK) {
      if (!this.opened) counters.streamsRefused += 1;
      log('info', `stream ${this.clientName || this.peer} ended: ${grpc.status[status.code]}: ${status.details}`);
      this.call.emit('error', status);
    } else {
      this.call.end();
    }
    onStreamGone();
  }

  protocolError(code, details) {
    this.broken = true;
    // Answer what is pending, then end the call with the status.
    this.enqueue(() => this.finish({ code, details }));
  }

  onRequest(req) {
    if (this.done || this.broken) return;
    if (req.kind === 'open') {
      if (this.opened) {
        this.protocolError(grpc.status.INVALID_ARGUMENT, 'open: sent twice on one stream');
        return;
      }
      const v = validateOpen(req.open);
      if (v.code !== undefined) {
        this.protocolError(v.code, v.details);
        return;
      }
      this.opened = true;
      this.plans = v.plans;
      this.readinessTimeoutMs = req.open.readiness_timeout_ms || opts.readinessTimeoutMs;
      this.contractVersion = req.open.contract_version || 1;
      this.clientName = req.open.client_name || '';
      counters.streamsOpened += 1;
      log(
        'debug',
        `stream opened by ${JSON.stringify(this.clientName)} (${this.peer}): stages ` +
          `[${[...this.plans.keys()].join(', ')}], contract_version ${this.contractVersion}`,
      );
      if (draining) this.onDrain();
      return;
    }
    if (!this.opened) {
      this.protocolError(
        grpc.status.INVALID_ARGUMENT,
        `open: the first message of a Materialize stream must be open, got ${req.kind || 'an empty request'}`,
      );
      return;
    }
    if (req.kind !== 'snapshot') {
      this.protocolError(grpc.status.INVALID_ARGUMENT, 'kind: request carries neither open nor snapshot');
      return;
    }
    if (this.closing) return; // draining a version-1 stream: new snapshots are not read
    const snap = req.snapshot;
    // Admission runs in arrival order.
    const admission = this.admit(snap);
    this.enqueue(async () => {
      if (this.done) return;
      const resp = await this.answer(snap, admission);
      if (this.done || resp === null) return;
      this.call.write(prune(resp));
    });
  }

  admit(snap) {
    const stageId = snap.stage_id || 0;
    const plan = this.plans.get(stageId);
    if (!plan) {
      return new StepFail(
        Code.INVALID_ARGUMENT,
        `snapshot.stage_id: stage ${stageId} was not declared when the stream opened ` +
          `(declared: [${[...this.plans.keys()].join(', ')}])`,
      );
    }
    const stepId = BigInt(snap.step_id || 0);
    const last = this.lastStep.get(stageId);
    if (last !== undefined && stepId <= last) {
      return new StepFail(
        Code.INVALID_ARGUMENT,
        `snapshot.step_id: ${stepId} is not after the previous step ${last} of stage ${stageId}`,
      );
    }
    this.lastStep.set(stageId, stepId);
    return plan;
  }

  async answer(snap, admission) {
    const stepId = String(snap.step_id || '0');
    const stageId = snap.stage_id || 0;
    const released = collectReleases(snap);
    const t0 = process.hrtime.bigint();
    let failure;
    let built;
    if (admission instanceof StepFail) {
      failure = admission;
    } else {
      try {
        built = await buildStep(snap, {
          shmPrefix: opts.shmPrefix,
          plan: admission,
          readinessTimeoutMs: this.readinessTimeoutMs,
          deadline: Date.now() + this.readinessTimeoutMs,
          isCancelled: () => this.done,
        });
      } catch (e) {
        if (e instanceof StepFail) {
          failure = e;
        } else {
          log('error', `step ${stepId} of stage ${stageId}: ${e && e.stack ? e.stack : e}`);
          failure = new StepFail(Code.INTERNAL, `internal error: ${e && e.message ? e.message : e}`);
        }
      }
    }
    if (this.done) return null; // cancelled while waiting: drop the stream
    const secs = Number(process.hrtime.bigint() - t0) / 1e9;
    if (failure) {
      counters.stepsFailed += 1n;
      counters.failuresByCode[failure.code] = (counters.failuresByCode[failure.code] || 0) + 1;
      log('debug', `step ${stepId} of stage ${stageId} failed (${failure.code}): ${failure.message}`);
      return {
        error: {
          step_id: stepId,
          stage_id: stageId,
          code: failure.code,
          message: failure.message,
          released_slots: released,
        },
      };
    }
    counters.stepsMaterialized += 1n;
    log('debug', `step ${stepId} of stage ${stageId}: ${built.requests.length} requests in ${secs.toFixed(6)} s`);
    return {
      step: {
        step_id: stepId,
        stage_id: stageId,
        requests: built.requests,
        connector_signals: built.connector_signals,
        released_slots: released,
      },
    };
  }

  onHalfClose() {
    if (this.done) return;
    if (!this.opened && !this.broken) {
      this.protocolError(grpc.status.INVALID_ARGUMENT, 'open: stream closed before the open message');
      return;
    }
    this.enqueue(() => this.finish());
  }

  onCancel() {
    if (this.done) return;
    this.cancelled = true;
    this.done = true;
    counters.streamsCancelled += 1;
    streams.delete(this);
    log('debug', `stream ${this.clientName || this.peer} cancelled`);
    onStreamGone();
  }

  /** On drain: StreamDraining to a version-2 sender; a version-1 stream is wound up. */
  onDrain() {
    if (this.done || !this.opened) return;
    if (this.contractVersion >= 2) {
      if (this.drainSent) return;
      this.drainSent = true;
      this.call.write(prune(drainingMessage()));
      return;
    }
    // Version 1 knows no StreamDraining: stop reading new snapshots, answer
    // those received, and end the stream OK.
    if (this.closing || this.broken) return;
    this.closing = true;
    this.call.pause();
    this.enqueue(() => this.finish());
  }
}

/**
 * Drops proto3 default values (0, "0", "", false, []) from an outgoing
 * message: protobufjs writes a scalar that is explicitly set even when it is
 * the default, and the shipped implementations do not, so pruning keeps the
 * answers byte-identical on the wire. Bytes (inline_data, a oneof member)
 * are kept even when empty: their presence is meaningful.
 */
function prune(v) {
  if (Array.isArray(v)) return v.map(prune);
  if (v === null || typeof v !== 'object' || Buffer.isBuffer(v)) return v;
  const out = {};
  for (const [k, x] of Object.entries(v)) {
    if (Buffer.isBuffer(x)) out[k] = x;
    else if (x === 0 || x === '0' || x === '' || x === false || x === undefined || x === null) continue;
    else if (Array.isArray(x) && x.length === 0) continue;
    else out[k] = prune(x);
  }
  return out;
}

function materialize(call) {
  const s = new MaterializeStream(call);
  streams.add(s);
}

// ---------------------------------------------------------------------------
// GetMaterializerInfo

const PROBE = { UNSPECIFIED: 0, MAPPED: 1, NOT_FOUND: 2, UNSUPPORTED: 3, INVALID: 4 };

function arenaProbe(name) {
  if (!name) return PROBE.UNSPECIFIED;
  if (!regionNameOk(name) || !name.startsWith(`${opts.shmPrefix}-arena-`)) return PROBE.INVALID;
  try {
    new Arena(name).close(); // opens read-only, reads and checks the header, closes
    return PROBE.MAPPED;
  } catch (e) {
    if (e instanceof ArenaError && e.kind === 'not_found') return PROBE.NOT_FOUND;
    return PROBE.INVALID;
  }
}

function getMaterializerInfo(call, callback) {
  const req = call.request || {};
  callback(null, {
    implementation: 'node',
    version: PKG.version,
    contract: CONTRACT,
    supports_shm: true,
    supports_inline: true,
    shm_prefix: opts.shmPrefix,
    active_streams: streams.size,
    steps_materialized: counters.stepsMaterialized.toString(),
    steps_failed: counters.stepsFailed.toString(),
    instance_id: instanceId,
    start_time_unix_ms: String(startTimeMs),
    contract_version: CONTRACT_VERSION,
    supports_drain: true,
    draining,
    arena_probe: arenaProbe(req.arena_probe || ''),
  });
}

// ---------------------------------------------------------------------------
// grpc.health.v1.Health

const SERVING = 1;
const NOT_SERVING = 2;
const SERVICE_UNKNOWN = 3;
const healthWatchers = new Set();

function healthStatus(service) {
  if (service === '' || service === SERVICE_NAME) return draining ? NOT_SERVING : SERVING;
  return null;
}

const healthImpl = {
  Check(call, callback) {
    const service = (call.request && call.request.service) || '';
    const st = healthStatus(service);
    log('debug', `health check for service ${JSON.stringify(service)}: ${st === null ? 'unknown' : st}`);
    if (st === null) callback({ code: grpc.status.NOT_FOUND, details: 'unknown service' });
    else callback(null, { status: st });
  },
  Watch(call) {
    const service = (call.request && call.request.service) || '';
    const w = { call, service, last: null };
    const push = () => {
      const st = healthStatus(service);
      const v = st === null ? SERVICE_UNKNOWN : st;
      if (v !== w.last) {
        w.last = v;
        call.write({ status: v });
      }
    };
    w.push = push;
    healthWatchers.add(w);
    call.on('cancelled', () => healthWatchers.delete(w));
    push();
  },
};

// ---------------------------------------------------------------------------
// Drain and shutdown

let graceTimer = null;
let exiting = false;

function onStreamGone() {
  if (draining && streams.size === 0) shutdown(0);
}

function startDrain(reason) {
  if (draining) {
    log('warning', `${reason} again: stopping now`);
    shutdown(0, true);
    return;
  }
  draining = true;
  drainReason = reason;
  drainDeadline = Date.now() + opts.drainGraceMs;
  log('info', `${reason}: draining ${streams.size} stream(s), grace ${opts.drainGraceMs} ms`);
  for (const w of healthWatchers) w.push();
  for (const s of streams) s.onDrain();
  if (streams.size === 0) {
    shutdown(0);
    return;
  }
  graceTimer = setTimeout(() => {
    for (const s of [...streams]) {
      s.finish({ code: grpc.status.UNAVAILABLE, details: `materializer stopped (${reason}): drain grace period over` });
    }
    shutdown(0, true);
  }, opts.drainGraceMs);
}

function shutdown(rc, force) {
  if (exiting) return;
  exiting = true;
  if (graceTimer) clearTimeout(graceTimer);
  log(
    'info',
    `stopping: steps materialized ${counters.stepsMaterialized}, failed ${counters.stepsFailed}, streams opened ` +
      `${counters.streamsOpened}, refused ${counters.streamsRefused}, cancelled ${counters.streamsCancelled}, ` +
      `failures by code ${JSON.stringify(counters.failuresByCode)}`,
  );
  const done = () => {
    removeSocket();
    process.exit(rc);
  };
  if (!server) return done();
  if (force) {
    server.forceShutdown();
    setImmediate(done);
    return;
  }
  server.tryShutdown(() => done());
  setTimeout(() => {
    server.forceShutdown();
    done();
  }, 2000).unref();
}

// ---------------------------------------------------------------------------
// Listen

function unixPath(addr) {
  if (!addr.startsWith('unix:')) return null;
  let p = addr.slice('unix:'.length);
  if (p.startsWith('//')) p = p.slice(2); // unix:///abs -> /abs
  return p;
}

const sockPath = unixPath(opts.listen);

function removeSocket() {
  if (!sockPath) return;
  try {
    if (fs.lstatSync(sockPath).isSocket()) fs.unlinkSync(sockPath);
  } catch (_) {
    /* gone already */
  }
}

function main() {
  if (sockPath) removeSocket(); // a stale socket of an earlier run
  server = new grpc.Server({ 'grpc.max_receive_message_length': 256 * 1024 * 1024, 'grpc.max_send_message_length': 256 * 1024 * 1024 });
  server.addService(omni.MaterializerService.service, {
    Materialize: materialize,
    GetMaterializerInfo: getMaterializerInfo,
  });
  server.addService(health.Health.service, healthImpl);
  server.bindAsync(opts.listen, grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) {
      log('error', `cannot listen on ${opts.listen}: ${err.message}`);
      process.exit(1);
    }
    log(
      'info',
      `serving ${SERVICE_NAME} (contract ${CONTRACT} v${CONTRACT_VERSION}) for ${opts.shmPrefix} on ${opts.listen}` +
        (sockPath ? '' : ` (port ${port})`),
    );
  });
  process.on('SIGTERM', () => startDrain('SIGTERM'));
  process.on('SIGINT', () => startDrain('SIGINT'));
}

main();
