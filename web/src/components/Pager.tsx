/** Previous / next through the pages of a list, with where we are; announced politely when it changes. */
import type { Page } from "../lib/adapters";

export function Pager<T>(props: { page: Page<T>; total: number; onPage: (p: number) => void; testid: string; noun: string }) {
  const { page } = props;
  if (props.total === 0) return null;
  return (
    <nav class="pager" aria-label={`Pages of ${props.noun}`} data-testid={props.testid}>
      <button type="button" class="btn btn-small" disabled={page.page <= 1} onClick={() => props.onPage(page.page - 1)} data-testid={`${props.testid}-prev`}>
        ← Previous
      </button>
      <span aria-live="polite" data-testid={`${props.testid}-status`}>
        {page.first}–{page.last} of {props.total} {props.noun} · page {page.page} of {page.pages}
      </span>
      <button type="button" class="btn btn-small" disabled={page.page >= page.pages} onClick={() => props.onPage(page.page + 1)} data-testid={`${props.testid}-next`}>
        Next →
      </button>
    </nav>
  );
}
