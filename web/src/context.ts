/** What every page needs: the API client and the signed-in user. */
import { createContext } from "preact";
import { useContext } from "preact/hooks";
import type { ApiClient } from "./api/client";
import type { User } from "./api/types";

export interface AppContextValue {
  client: ApiClient;
  user: User;
}

export const AppContext = createContext<AppContextValue | null>(null);

export function useApp(): AppContextValue {
  const ctx = useContext(AppContext);
  if (!ctx) throw new Error("useApp outside a signed-in AppContext");
  return ctx;
}
