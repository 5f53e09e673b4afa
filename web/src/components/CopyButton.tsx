/** Copies text to the clipboard and says so; falls back to selecting the text where the API is missing. */
import { useState } from "preact/hooks";

async function copyText(text: string, fallbackInput: HTMLInputElement | null): Promise<boolean> {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch {
      // permission denied: fall through to selection
    }
  }
  if (fallbackInput) {
    fallbackInput.focus();
    fallbackInput.select();
    try {
      return document.execCommand("copy");
    } catch {
      return false;
    }
  }
  return false;
}

export function CopyButton(props: { text: string; inputId?: string; testid: string; label?: string }) {
  const [state, setState] = useState<"idle" | "copied" | "manual">("idle");
  const onClick = async () => {
    const input = props.inputId ? (document.getElementById(props.inputId) as HTMLInputElement | null) : null;
    setState((await copyText(props.text, input)) ? "copied" : "manual");
  };
  return (
    <>
      <button type="button" class="btn" onClick={onClick} data-testid={props.testid}>
        {state === "copied" ? "Copied" : (props.label ?? "Copy")}
      </button>
      <span class="live" aria-live="polite" data-testid={`${props.testid}-status`}>
        {state === "copied" ? "Copied to the clipboard." : state === "manual" ? "Copy blocked by the browser: the text is selected, press Ctrl+C." : ""}
      </span>
    </>
  );
}
