'use strict';
// Builds one MaterializeResponse from one StepSnapshot and the stream's
// stage plan, following docs/writing-a-materializer.md: "Stage plans",
// "Validating a step: the order of checks" (B, C, D, E, F; A runs at
// admission in server.js), "Shared memory" and "Connector signals".
//
// buildStep() throws StepFail for a step that cannot be built; the caller
// turns it into a StepError carrying the code and a message that names the
// offending field.

const { Arena, ArenaError, regionNameOk, U64_MAX } = require('./arena');

// gRPC status codes used in StepError.code.
const Code = {
  OK: 0,
  CANCELLED: 1,
  INVALID_ARGUMENT: 3,
  DEADLINE_EXCEEDED: 4,
  NOT_FOUND: 5,
  PERMISSION_DENIED: 7,
  FAILED_PRECONDITION: 9,
  ABORTED: 10,
  OUT_OF_RANGE: 11,
  INTERNAL: 13,
  UNAVAILABLE: 14,
};

// omni_serving.v1.DType -> [name used in messages, itemsize]
const DTYPES = {
  1: ['float32', 4],
  2: ['float16', 2],
  3: ['bfloat16', 2],
  4: ['float64', 8],
  5: ['int8', 1],
  6: ['uint8', 1],
  7: ['int16', 2],
  8: ['int32', 4],
  9: ['int64', 8],
  10: ['bool', 1],
};
const SUPPORTED = Object.entries(DTYPES)
  .map(([v, [name]]) => `${v} (${name})`)
  .join(', ');

// TensorLayout
const PER_TOKEN = 1;
const PER_REQUEST = 2;
// PayloadDestination
const INTER_STAGE = 1;
const CLIENT = 2;
// RowSelection
const SEL_ALL = 1;
const SEL_LAST = 2;

const SAMPLED = 'sampled_token_ids';

class StepFail extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

function fail(code, msg) {
  throw new StepFail(code, msg);
}

const q = (s) => `'${s}'`;
const shapeStr = (shape) => '[' + shape.map(String).join(', ') + ']';

function big(v) {
  // 64-bit integers arrive as decimal strings (proto-loader longs: String); absent = 0.
  if (v === undefined || v === null || v === '') return 0n;
  return BigInt(v);
}

/**
 * Every distinct (region, slot, generation) named by the snapshot's handles,
 * valid or not, read or not, in first-appearance order over the tensor
 * fields in field-number order.
 */
function collectReleases(snap) {
  const refs = [snap.sampled_token_ids, snap.logprobs, snap.prompt_logprobs, snap.query_start_loc, snap.hidden_states];
  for (const mo of snap.multimodal_outputs || []) refs.push(mo && mo.tensor);
  const seen = new Set();
  const out = [];
  for (const t of refs) {
    if (!t || t.data !== 'shm' || !t.shm) continue;
    const region = t.shm.region || '';
    const slot = t.shm.slot || 0;
    const generation = big(t.shm.generation).toString();
    const key = `${region}\0${slot}\0${generation}`;
    if (seen.has(key)) continue;
    seen.add(key);
    out.push({ region, slot, generation });
  }
  return out;
}

// ---------------------------------------------------------------------------
// C3: the TensorRef itself

function checkTensorRef(ref, f) {
  const dtype = ref.dtype || 0;
  const dt = DTYPES[dtype];
  if (!dt) fail(Code.INVALID_ARGUMENT, `${f}.dtype: unknown dtype value ${dtype}; supported: ${SUPPORTED}`);
  const [dtName, itemsize] = dt;
  const shape = (ref.shape || []).map(big);
  shape.forEach((d, j) => {
    if (d < 0n) fail(Code.INVALID_ARGUMENT, `${f}.shape[${j}]: dimension must be >= 0, got ${d}`);
  });
  let need = BigInt(itemsize);
  for (const d of shape) need *= d;
  if (need > U64_MAX) {
    fail(Code.INVALID_ARGUMENT, `${f}.shape: tensor of shape ${shapeStr(shape)} overflows 64-bit byte size`);
  }
  const desc = { f, dtype, dtName, itemsize, shape, need, inline: null, handle: null };
  if (ref.data === 'inline_data') {
    const data = ref.inline_data || Buffer.alloc(0);
    if (BigInt(data.length) !== need) {
      fail(
        Code.INVALID_ARGUMENT,
        `${f}.inline_data: has ${data.length} bytes, shape ${shapeStr(shape)} of ${dtName} needs ${need}`,
      );
    }
    desc.inline = data;
    return desc;
  }
  if (ref.data === 'shm' && ref.shm) {
    const byteSize = big(ref.shm.byte_size);
    if (byteSize !== need) {
      fail(
        Code.INVALID_ARGUMENT,
        `${f}.shm.byte_size: is ${byteSize}, shape ${shapeStr(shape)} of ${dtName} needs ${need}`,
      );
    }
    return desc;
  }
  fail(Code.INVALID_ARGUMENT, `${f}.data: neither inline_data nor shm is set`);
}

// ---------------------------------------------------------------------------
// D1-D9: the handle against the arena

function openArena(region, h, ctx) {
  let arena = ctx.arenas.get(region);
  if (arena) return arena;
  try {
    arena = new Arena(region);
  } catch (e) {
    if (!(e instanceof ArenaError)) throw e;
    if (e.kind === 'not_found') fail(Code.NOT_FOUND, `${h}.region: unknown region ${q(region)}`);
    if (e.kind === 'denied') {
      fail(Code.PERMISSION_DENIED, `${h}.region: region ${q(region)} is not readable by this process (${e.message})`);
    }
    if (e.kind === 'open_failed') {
      fail(Code.INVALID_ARGUMENT, `${h}.region: region ${q(region)} cannot be opened: ${e.message}`);
    }
    fail(Code.INVALID_ARGUMENT, `${h}.region: region ${q(region)} ${e.message}`);
  }
  ctx.arenas.set(region, arena);
  return arena;
}

function checkHandle(ref, desc, ctx) {
  const shm = ref.shm;
  const h = `${desc.f}.shm`;
  const region = shm.region || '';
  const offset = big(shm.offset);
  const byteSize = big(shm.byte_size);
  const slot = shm.slot || 0;
  const generation = big(shm.generation);
  if (!regionNameOk(region)) {
    fail(Code.INVALID_ARGUMENT, `${h}.region: region name ${JSON.stringify(region)} is malformed or path-like`);
  }
  const allowed = `${ctx.shmPrefix}-arena-`;
  if (!region.startsWith(allowed)) {
    fail(Code.PERMISSION_DENIED, `${h}.region: region ${q(region)} is outside deployment prefix ${q(allowed)}`);
  }
  const arena = openArena(region, h, ctx); // D3, D4
  if (offset + byteSize > U64_MAX) {
    fail(Code.INVALID_ARGUMENT, `${h}.byte_size: offset ${offset} + byte_size ${byteSize} overflows 64 bits`);
  }
  if (offset > arena.size) {
    fail(Code.OUT_OF_RANGE, `${h}.offset: ${offset} is past the end of region ${q(region)} (${arena.size} bytes)`);
  }
  if (offset + byteSize > arena.size) {
    fail(
      Code.OUT_OF_RANGE,
      `${h}.byte_size: offset ${offset} + byte_size ${byteSize} is past the end of region ${q(region)} ` +
        `(${arena.size} bytes)`,
    );
  }
  if (slot >= arena.numSlots) {
    fail(Code.OUT_OF_RANGE, `${h}.slot: ${slot} is out of range (region has ${arena.numSlots} slots)`);
  }
  const [lo, hi] = arena.slotRange(slot);
  if (offset < lo || offset + byteSize > hi) {
    fail(
      Code.OUT_OF_RANGE,
      `${h}.offset: bytes [${offset}, ${offset + byteSize}) are not inside slot ${slot} [${lo}, ${hi})`,
    );
  }
  return { arena, region, offset, byteSize, slot, generation, h };
}

function staleFail(hd, current) {
  fail(
    Code.ABORTED,
    `${hd.h}.generation: stale handle, slot ${hd.slot} is at generation ${current}, handle has ${hd.generation}`,
  );
}

const sleep = (ms) => new Promise((resolve) => (ms >= 1 ? setTimeout(resolve, ms) : setImmediate(resolve)));

/** D10 and D11: the generation matches, then poll until the slot is marked ready or the step's deadline passes. */
async function waitReady(hd, ctx) {
  let delay = 0.05; // ms: start at about 50 us, back off to 1 ms
  for (;;) {
    if (ctx.isCancelled()) throw new StepFail(Code.CANCELLED, 'stream cancelled');
    const st = hd.arena.slotState(hd.slot);
    if (st.generation !== hd.generation) staleFail(hd, st.generation);
    if (st.ready === hd.generation) return; // ready at the first look is read even past the deadline
    if (Date.now() >= ctx.deadline) {
      fail(
        Code.DEADLINE_EXCEEDED,
        `${hd.h}: slot ${hd.slot} generation ${hd.generation} of ${q(hd.region)} was not ready in time ` +
          `(${ctx.readinessTimeoutMs} ms)`,
      );
    }
    await sleep(delay);
    delay = Math.min(delay * 2, 1);
  }
}

// ---------------------------------------------------------------------------
// Slicing

function rowBytes(t) {
  let elems = 1n;
  for (let k = 1; k < t.shape.length; k++) elems *= t.shape[k];
  return Number(elems) * t.itemsize;
}

function sliceRows(t, r0, r1) {
  const rb = rowBytes(t);
  return {
    dtype: t.dtype,
    shape: [String(r1 - r0), ...t.shape.slice(1).map(String)],
    inline_data: Buffer.from(t.bytes.subarray(r0 * rb, r1 * rb)), // the one copy, into the message
  };
}

function sliceSampled(t, i, selection, count) {
  const isz = t.itemsize;
  const base = i * Number(t.shape[1]) * isz;
  let c0 = 0;
  if (selection === SEL_LAST && count > 0) c0 = count - 1;
  return {
    dtype: t.dtype,
    shape: [String(count - c0)],
    inline_data: Buffer.from(t.bytes.subarray(base + c0 * isz, base + count * isz)),
  };
}

// ---------------------------------------------------------------------------
// The step

/**
 * Build the answer to one admitted snapshot (checks B-F).
 * ctx: { shmPrefix, plan, deadline, readinessTimeoutMs, isCancelled }
 * Returns { requests, connector_signals }.
 */
async function buildStep(snap, ctx) {
  const plan = ctx.plan;
  const ids = snap.request_ids || [];
  const n = ids.length;

  // B. Metadata.
  const spans = snap.scheduled_spans || [];
  if (spans.length !== n) {
    fail(Code.INVALID_ARGUMENT, `snapshot.scheduled_spans: has ${spans.length} entries for ${n} request_ids`);
  }
  const nst = snap.num_sampled_tokens || [];
  if (nst.length !== 0 && nst.length !== n) {
    fail(Code.INVALID_ARGUMENT, `snapshot.num_sampled_tokens: has ${nst.length} entries for ${n} request_ids`);
  }
  let prevEnd = 0;
  spans.forEach((s, i) => {
    const a = s.start || 0;
    const b = s.end || 0;
    if (b < a || a < prevEnd) {
      fail(Code.INVALID_ARGUMENT, `snapshot.scheduled_spans[${i}]: span [${a}, ${b}) is not ordered`);
    }
    prevEnd = b;
  });
  const idSet = new Set(ids);
  for (const d of snap.downstream_request_ids || []) {
    if (!idSet.has(d)) fail(Code.INVALID_ARGUMENT, `snapshot.downstream_request_ids: ${q(d)} is not in request_ids`);
  }

  // C and D. Step tensors in order; a routed one is resolved (validated,
  // waited for, read) before the next one is looked at.
  const routed = new Set(plan.routes.map((r) => r.source));
  const entries = [];
  if (snap.sampled_token_ids) {
    entries.push({ name: SAMPLED, ref: snap.sampled_token_ids, layout: SAMPLED, f: 'snapshot.sampled_token_ids' });
  }
  if (snap.hidden_states) {
    entries.push({ name: 'hidden_states', ref: snap.hidden_states, layout: PER_TOKEN, f: 'snapshot.hidden_states' });
  }
  (snap.multimodal_outputs || []).forEach((mo, k) => {
    entries.push({ name: mo.name || '', mo, k, ref: mo.tensor || {}, f: `snapshot.multimodal_outputs[${k}].tensor` });
  });
  const tensors = new Map(); // name -> resolved step tensor
  const seen = new Set();
  const readHandles = [];
  ctx.arenas = new Map();
  try {
    for (const e of entries) {
      if (e.mo) {
        const layout = e.mo.layout || 0;
        if (layout !== PER_TOKEN && layout !== PER_REQUEST) {
          fail(
            Code.INVALID_ARGUMENT,
            `snapshot.multimodal_outputs[${e.k}].layout: must be PER_TOKEN or PER_REQUEST, got ${layout}`,
          );
        }
        e.layout = e.name === SAMPLED ? SAMPLED : layout;
      }
      if (seen.has(e.name)) fail(Code.INVALID_ARGUMENT, `${e.f}: a second step tensor named ${q(e.name)}`);
      seen.add(e.name);
      if (!routed.has(e.name)) continue; // never validated nor read
      const desc = checkTensorRef(e.ref, e.f);
      let bytes = desc.inline;
      if (!bytes) {
        const hd = checkHandle(e.ref, desc, ctx);
        await waitReady(hd, ctx);
        bytes = hd.arena.read(Number(hd.offset), Number(hd.byteSize));
        readHandles.push(hd);
      }
      tensors.set(e.name, {
        name: e.name,
        layout: e.layout,
        dtype: desc.dtype,
        itemsize: desc.itemsize,
        shape: desc.shape,
        bytes,
      });
    }

    // E1-E5, route by route.
    const counts = nst.length ? nst : new Array(n).fill(1);
    plan.routes.forEach((r) => {
      const t = tensors.get(r.source);
      if (!t) fail(Code.INVALID_ARGUMENT, `plan.routes.source: step ${snap.step_id || 0} has no tensor ${q(r.source)}`);
      if (t.shape.length < 1) fail(Code.INVALID_ARGUMENT, `${t.name}: a step tensor needs a row dimension, got a scalar`);
      if (t.layout === SAMPLED) {
        if (t.shape.length !== 2) {
          fail(
            Code.INVALID_ARGUMENT,
            `${t.name}: must be [num_requests, max_tokens], got shape ${shapeStr(t.shape)}`,
          );
        }
        counts.forEach((c, i) => {
          if (BigInt(c) > t.shape[1]) {
            fail(
              Code.INVALID_ARGUMENT,
              `snapshot.num_sampled_tokens: [${i}] is ${c}, sampled_token_ids has ${t.shape[1]} columns`,
            );
          }
        });
      }
      if ((t.layout === SAMPLED || t.layout === PER_REQUEST) && t.shape[0] < BigInt(n)) {
        fail(Code.INVALID_ARGUMENT, `${t.name}: has ${t.shape[0]} rows for ${n} requests`);
      }
    });

    // Build: request by request, route by route (E6 on the way).
    const downstream = new Set(snap.downstream_request_ids || []);
    const finished = new Set(snap.finished_request_ids || []);
    const requests = [];
    for (let i = 0; i < n; i++) {
      const rid = ids[i];
      const inter = [];
      const client = [];
      for (const r of plan.routes) {
        if (r.destination === INTER_STAGE && !downstream.has(rid)) continue;
        const t = tensors.get(r.source);
        let tensor;
        if (t.layout === SAMPLED) {
          tensor = sliceSampled(t, i, r.selection, counts[i]);
        } else if (t.layout === PER_REQUEST) {
          tensor = sliceRows(t, i, i + 1);
        } else {
          const a = spans[i].start || 0;
          const b = spans[i].end || 0;
          if (BigInt(b) > t.shape[0]) {
            fail(Code.INVALID_ARGUMENT, `${t.name}: span [${a}, ${b}) of request ${i} is past ${t.shape[0]} rows`);
          }
          tensor = r.selection === SEL_LAST && b > a ? sliceRows(t, b - 1, b) : sliceRows(t, a, b);
        }
        (r.destination === INTER_STAGE ? inter : client).push({ name: r.key, tensor });
      }
      // A payload with nothing in it stays unset (the canonical form).
      const rp = { request_id: rid, finished: finished.has(rid) };
      if (inter.length) rp.inter_stage = { tensors: inter };
      if (client.length) rp.client = { tensors: client };
      requests.push(rp);
    }

    // F. Every handle that was read: is its slot still at the same generation?
    for (const hd of readHandles) {
      const st = hd.arena.slotState(hd.slot);
      if (st.generation !== hd.generation) staleFail(hd, st.generation);
    }

    const signals = ((snap.connector_output || {}).signals || []).map((s) => ({
      request_id: s.request_id || '',
      kind: s.kind || '',
      value: s.value || '0',
    }));
    return { requests, connector_signals: signals };
  } finally {
    for (const a of ctx.arenas.values()) a.close();
    ctx.arenas = null;
  }
}

module.exports = {
  Code,
  StepFail,
  DTYPES,
  PER_TOKEN,
  PER_REQUEST,
  INTER_STAGE,
  CLIENT,
  SEL_ALL,
  SEL_LAST,
  collectReleases,
  buildStep,
};
