// Vite build for the SPA the gateway serves at `/`; `npm run dev` proxies /api and /v1 to a running gateway.
import { defineConfig } from "vitest/config";

import { precompress } from "./scripts/precompress";

const gateway = process.env.MPLEX_GATEWAY_URL ?? "http://127.0.0.1:8000";

export default defineConfig({
  oxc: { jsx: { runtime: "automatic", importSource: "preact" } },
  // .br and .gz beside each asset, served by the gateway by Accept-Encoding.
  plugins: [precompress()],
  build: {
    outDir: "dist",
    emptyOutDir: true,
    target: "es2022",
    // Hashed file names under assets/ let the gateway cache them forever; index.html stays no-cache.
    assetsDir: "assets",
    sourcemap: false,
  },
  server: {
    proxy: {
      "/api": { target: gateway, changeOrigin: false },
      "/v1": { target: gateway, changeOrigin: false },
    },
  },
  test: {
    include: ["tests/**/*.test.{ts,tsx}"],
    environment: "node",
  },
});
