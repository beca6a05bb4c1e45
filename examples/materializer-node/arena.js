'use strict';
// Read-only access to the decoder's shared-memory arena
// (docs/writing-a-materializer.md, "Shared memory").
//
//   offset 0               header, 64 bytes: "<8sIIQQ"
//                          magic "OMNIARN1", version 1, num_slots, slot_bytes, data_offset
//   offset 64 + 64*s       slot table entry of slot s: "<QQ" generation, ready_generation
//   data_offset + s*slot_bytes   slot s's data
//
// The segment is opened with O_RDONLY and read with pread(2) (fs.readSync at
// an offset); nothing is mapped and nothing is ever written.

const fs = require('fs');
const path = require('path');

const SHM_DIR = '/dev/shm';
const MAGIC = Buffer.from('OMNIARN1', 'latin1');
const VERSION = 1;
const HEADER_BYTES = 64;
const SLOT_ENTRY_BYTES = 64;
const U64_MAX = (1n << 64n) - 1n;

const REGION_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$/;

/** Check D1: not empty, no '/', '\\', NUL or '..', and ^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$. */
function regionNameOk(name) {
  return (
    typeof name === 'string' &&
    name.length > 0 &&
    !name.includes('/') &&
    !name.includes('\\') &&
    !name.includes('..') &&
    !name.includes('\0') &&
    REGION_RE.test(name)
  );
}

class ArenaError extends Error {
  /** kind: 'not_found' | 'denied' | 'open_failed' | 'not_arena' */
  constructor(kind, message) {
    super(message);
    this.kind = kind;
  }
}

function preadExact(fd, length, position) {
  const buf = Buffer.allocUnsafe(length);
  let done = 0;
  while (done < length) {
    const n = fs.readSync(fd, buf, done, length - done, position + done);
    if (n === 0) {
      throw new ArenaError('not_arena', `is not an arena (short read at offset ${position + done})`);
    }
    done += n;
  }
  return buf;
}

/** An arena segment opened read-only. Call close() when done. */
class Arena {
  constructor(region) {
    this.region = region;
    let fd;
    try {
      fd = fs.openSync(path.join(SHM_DIR, region), 'r');
    } catch (e) {
      if (e.code === 'ENOENT' || e.code === 'ENOTDIR') {
        throw new ArenaError('not_found', `no segment /dev/shm/${region}`);
      }
      if (e.code === 'EACCES' || e.code === 'EPERM') {
        throw new ArenaError('denied', `${e.code}`);
      }
      throw new ArenaError('open_failed', `${e.code || e.message}`);
    }
    this.fd = fd;
    try {
      const st = fs.fstatSync(fd);
      if (!st.isFile()) throw new ArenaError('open_failed', 'not a regular file');
      this.size = BigInt(st.size);
      if (this.size < BigInt(HEADER_BYTES)) {
        throw new ArenaError('not_arena', `is not an arena (${st.size} bytes)`);
      }
      const h = preadExact(fd, HEADER_BYTES, 0);
      if (!h.subarray(0, 8).equals(MAGIC)) throw new ArenaError('not_arena', `is not an arena (${st.size} bytes, bad magic)`);
      const version = h.readUInt32LE(8);
      if (version !== VERSION) throw new ArenaError('not_arena', `is not an arena of version ${VERSION} (version ${version})`);
      this.numSlots = h.readUInt32LE(12);
      this.slotBytes = h.readBigUInt64LE(16);
      this.dataOffset = h.readBigUInt64LE(24);
      const tableEnd = BigInt(HEADER_BYTES + SLOT_ENTRY_BYTES * this.numSlots);
      if (this.dataOffset < tableEnd) {
        throw new ArenaError(
          'not_arena',
          `has an inconsistent arena header (data_offset ${this.dataOffset} < slot table end ${tableEnd})`,
        );
      }
      const dataEnd = this.dataOffset + BigInt(this.numSlots) * this.slotBytes;
      if (dataEnd > this.size) {
        throw new ArenaError(
          'not_arena',
          `has an inconsistent arena header (slots end at ${dataEnd}, past the ${this.size} bytes)`,
        );
      }
    } catch (e) {
      this.close();
      if (e instanceof ArenaError) throw e;
      throw new ArenaError('open_failed', e.message);
    }
  }

  /** [start, end) of slot s's data, as BigInt. */
  slotRange(slot) {
    const start = this.dataOffset + BigInt(slot) * this.slotBytes;
    return [start, start + this.slotBytes];
  }

  /** Current {generation, ready} of slot s (BigInt). */
  slotState(slot) {
    const b = preadExact(this.fd, 16, HEADER_BYTES + SLOT_ENTRY_BYTES * slot);
    return { generation: b.readBigUInt64LE(0), ready: b.readBigUInt64LE(8) };
  }

  /** Copy `length` bytes at `offset` (validated by the caller) into a new Buffer. */
  read(offset, length) {
    if (length === 0) return Buffer.alloc(0);
    return preadExact(this.fd, length, offset);
  }

  close() {
    if (this.fd !== undefined) {
      try {
        fs.closeSync(this.fd);
      } catch (_) {
        /* already closed */
      }
      this.fd = undefined;
    }
  }
}

module.exports = { Arena, ArenaError, regionNameOk, U64_MAX };
