// Vite plugin: after the build, writes `<file>.br` and `<file>.gz` beside every compressible file in dist/
// so the gateway (services/gateway/static.py) serves them by Accept-Encoding without compressing per request.
// Build time rather than gateway start: Node's zlib has brotli (Python's stdlib does not), the result is
// compressed once at the highest levels, and the gateway's read-only root filesystem needs no cache dir.
import { readdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { brotliCompressSync, constants, gzipSync } from "node:zlib";
import type { Plugin } from "vite";

const COMPRESSIBLE = /\.(?:js|mjs|css|html|svg|json|txt|map|wasm)$/;
const MIN_BYTES = 1024; // below one packet the header bytes eat the gain
const MAX_RATIO = 0.9; // a variant must save at least 10% to be worth a second file

function walk(dir: string): string[] {
  return readdirSync(dir).flatMap((name) => {
    const path = join(dir, name);
    return statSync(path).isDirectory() ? walk(path) : [path];
  });
}

export function compressFile(path: string): string[] {
  const raw = readFileSync(path);
  if (raw.length < MIN_BYTES) return [];
  const variants: [string, Buffer][] = [
    [".br", brotliCompressSync(raw, {
      params: {
        [constants.BROTLI_PARAM_QUALITY]: constants.BROTLI_MAX_QUALITY,
        [constants.BROTLI_PARAM_MODE]: constants.BROTLI_MODE_TEXT,
        [constants.BROTLI_PARAM_SIZE_HINT]: raw.length,
      },
    })],
    [".gz", gzipSync(raw, { level: 9 })],
  ];
  const written: string[] = [];
  for (const [suffix, body] of variants) {
    if (body.length <= raw.length * MAX_RATIO) {
      writeFileSync(path + suffix, body);
      written.push(path + suffix);
    }
  }
  return written;
}

export function precompress(): Plugin {
  return {
    name: "mplex-precompress",
    apply: "build",
    writeBundle(options) {
      if (!options.dir) return;
      for (const path of walk(options.dir)) {
        if (COMPRESSIBLE.test(path)) compressFile(path);
      }
    },
  };
}
