/** An <a> that routes inside the app. */
import type { ComponentChildren } from "preact";
import { onLinkClick } from "../lib/router";

export function Link(props: { to: string; children: ComponentChildren; class?: string; testid?: string; current?: boolean }) {
  return (
    <a
      href={props.to}
      class={props.class}
      data-testid={props.testid}
      aria-current={props.current ? "page" : undefined}
      onClick={(ev) => onLinkClick(ev as unknown as MouseEvent, props.to)}
    >
      {props.children}
    </a>
  );
}
