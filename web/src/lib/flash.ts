/** A one-time notice carried across a navigation (e.g. "Adapter deleted" on the page a delete lands on). */
const KEY = "mplex.flash";

export function setFlash(message: string): void {
  try {
    window.sessionStorage.setItem(KEY, message);
  } catch {
    // storage blocked: the destination page just shows no notice
  }
}

/** The pending notice, removed so it is shown once; null when there is none. */
export function takeFlash(): string | null {
  try {
    const message = window.sessionStorage.getItem(KEY);
    window.sessionStorage.removeItem(KEY);
    return message;
  } catch {
    return null;
  }
}
