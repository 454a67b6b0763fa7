package v1

import "testing"

func TestPriorityRankOrdersHighestFirstAndUnknownAsNormal(t *testing.T) {
	for p, want := range map[string]int{PriorityHigh: 0, PriorityNormal: 1, "": 1, "urgent": 1, PriorityLow: 2} {
		if got := PriorityRank(p); got != want {
			t.Errorf("PriorityRank(%q) = %d, want %d", p, got, want)
		}
	}
}
