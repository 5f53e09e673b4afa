/** The adapter upload's multipart body, exactly as docs/api.md names its fields. */

export type UploadMode = "archive" | "files";

export interface UploadFields {
  name: string;
  mode: UploadMode;
  /** One .tar.gz/.zip in archive mode; adapter_config.json + adapter_model.safetensors in files mode. */
  files: File[];
  evalSet: File | null;
  minMargin: string;
  minFp8Agreement: string;
}

const ARCHIVE_RE = /\.(tar\.gz|tgz|zip)$/i;

/** What is wrong with the form before sending it, or null. The server re-checks everything. */
export function uploadProblem(f: UploadFields): string | null {
  if (!f.name.trim()) return "Give the adapter a name.";
  if (f.mode === "archive") {
    if (f.files.length !== 1) return "Choose one .tar.gz or .zip archive.";
    if (!ARCHIVE_RE.test(f.files[0].name)) return "The archive must be a .tar.gz or .zip file.";
  } else {
    const names = f.files.map((x) => x.name).sort();
    if (names.length !== 2 || names[0] !== "adapter_config.json" || names[1] !== "adapter_model.safetensors") {
      return "Choose both adapter_config.json and adapter_model.safetensors.";
    }
  }
  for (const [label, v] of [["Minimum margin", f.minMargin], ["Minimum FP8 agreement", f.minFp8Agreement]] as const) {
    if (v.trim() && !Number.isFinite(Number(v))) return `${label} must be a number.`;
  }
  return null;
}

export function buildUploadForm(f: UploadFields): FormData {
  const form = new FormData();
  form.append("name", f.name.trim());
  if (f.mode === "archive") form.append("file", f.files[0], f.files[0].name);
  else for (const file of f.files) form.append("files", file, file.name);
  if (f.evalSet) form.append("eval_set", f.evalSet, f.evalSet.name);
  if (f.minMargin.trim()) form.append("min_margin", f.minMargin.trim());
  if (f.minFp8Agreement.trim()) form.append("min_fp8_agreement", f.minFp8Agreement.trim());
  return form;
}

export function totalBytes(files: readonly File[]): number {
  return files.reduce((n, f) => n + f.size, 0);
}
