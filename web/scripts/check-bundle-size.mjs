#!/usr/bin/env node
// Fails when the built app (every file the browser downloads from dist/) is over the gzipped budget.
// Usage: node scripts/check-bundle-size.mjs [dist] [budget-bytes]
import { readdirSync, readFileSync, statSync } from "node:fs";
import { join, relative } from "node:path";
import { gzipSync } from "node:zlib";

const dist = process.argv[2] ?? "dist";
const budget = Number(process.argv[3] ?? 500_000);

function walk(dir) {
  return readdirSync(dir).flatMap((name) => {
    const p = join(dir, name);
    return statSync(p).isDirectory() ? walk(p) : [p];
  });
}

let files;
try {
  // .br/.gz siblings (scripts/precompress.ts) are other encodings of files already counted.
  files = walk(dist).filter((f) => !/\.(br|gz)$/.test(f));
} catch {
  console.error(`bundle-size: ${dist}/ does not exist; run \`npm run build\` first`);
  process.exit(1);
}
if (!files.some((f) => f.endsWith(".js")) || !files.some((f) => f.endsWith("index.html"))) {
  console.error(`bundle-size: ${dist}/ has no index.html or no JavaScript; the build is broken`);
  process.exit(1);
}

let raw = 0;
let gz = 0;
const rows = files.sort().map((f) => {
  const bytes = readFileSync(f);
  const g = gzipSync(bytes, { level: 9 }).length;
  raw += bytes.length;
  gz += g;
  return [relative(dist, f), bytes.length, g];
});
const kb = (n) => `${(n / 1000).toFixed(1)} kB`;
for (const [name, r, g] of rows) console.log(`  ${name.padEnd(40)} ${kb(r).padStart(10)} ${kb(g).padStart(10)} gzip`);
console.log(`bundle-size: ${files.length} files, ${kb(raw)} raw, ${kb(gz)} gzipped (budget ${kb(budget)})`);
if (gz > budget) {
  console.error(`bundle-size: over budget by ${kb(gz - budget)}`);
  process.exit(1);
}
