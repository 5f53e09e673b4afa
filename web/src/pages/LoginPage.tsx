/** Sign-in with email and password; the session lives in an HttpOnly cookie the server sets. */
import { useState } from "preact/hooks";
import type { ApiClient } from "../api/client";
import type { Session } from "../api/types";
import { FormError } from "../components/Status";
import { useAction } from "../lib/useAction";

export function LoginPage(props: { client: ApiClient; onSignedIn: (s: Session) => void; notice?: string | null }) {
  const [email, setEmail] = useState("");
  const [password, setPassword] = useState("");
  const action = useAction();

  const submit = (ev: Event) => {
    ev.preventDefault();
    void action.run(async () => props.onSignedIn(await props.client.login(email.trim(), password)));
  };

  return (
    <main id="main" class="login">
      <form class="card login-card" onSubmit={submit} aria-labelledby="login-title" data-testid="login-form">
        <h1 id="login-title">
          <span class="brand-mark" aria-hidden="true">
            ◆
          </span>{" "}
          Sign in to Multiplex
        </h1>
        {props.notice && (
          <p class="notice" role="status" data-testid="login-notice">
            {props.notice}
          </p>
        )}
        <div class="field">
          <label for="login-email">Email</label>
          <input
            id="login-email"
            type="email"
            autocomplete="username"
            required
            value={email}
            onInput={(e) => setEmail((e.target as HTMLInputElement).value)}
            data-testid="login-email"
          />
        </div>
        <div class="field">
          <label for="login-password">Password</label>
          <input
            id="login-password"
            type="password"
            autocomplete="current-password"
            required
            value={password}
            onInput={(e) => setPassword((e.target as HTMLInputElement).value)}
            data-testid="login-password"
          />
        </div>
        <FormError error={action.error} testid="login-error" />
        <button type="submit" class="btn btn-primary btn-block" disabled={action.busy} data-testid="login-submit">
          {action.busy ? "Signing in…" : "Sign in"}
        </button>
      </form>
    </main>
  );
}
