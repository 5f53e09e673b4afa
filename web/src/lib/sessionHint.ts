/**
 * Whether this browser signed in before. The session cookie is HttpOnly, so JavaScript cannot see it; without a
 * hint, every signed-out page load would call /api/auth/me, get the contract's 401, and Chromium would log that
 * as a console error. With no hint we show the sign-in form straight away. Holds no secret.
 */
const KEY = "mplex.session";

export function hasSessionHint(): boolean {
  try {
    return window.localStorage.getItem(KEY) === "1";
  } catch {
    return true; // storage blocked: ask the server every time
  }
}

export function setSessionHint(signedIn: boolean): void {
  try {
    if (signedIn) window.localStorage.setItem(KEY, "1");
    else window.localStorage.removeItem(KEY);
  } catch {
    // storage blocked: nothing to remember
  }
}
