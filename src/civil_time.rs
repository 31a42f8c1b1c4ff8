//! The calendar date and time of day of a Unix time, for the dates floodgate writes itself
//! (a file's `Last-Modified`, the access log's timestamps) without the formatting
//! machinery.

/// A time in UTC, to the second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CivilTime {
    pub year: u64,
    /// 1 to 12.
    pub month: u64,
    /// 1 to 31.
    pub day: u64,
    /// 0 (Sunday) to 6.
    pub weekday: u64,
    pub hour: u64,
    pub minute: u64,
    pub second: u64,
}

impl CivilTime {
    /// `secs` since 1970-01-01T00:00:00Z.
    pub(crate) fn of(secs: u64) -> CivilTime {
        let days = secs / 86_400;
        let of_day = secs % 86_400;
        // Howard Hinnant's days_from_civil, inverted, in eras of 400 years from 0000-03-01.
        let z = days + 719_468;
        let era = z / 146_097;
        let day_of_era = z % 146_097;
        let year_of_era =
            (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
        let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
        let shifted_month = (5 * day_of_year + 2) / 153;
        let month = if shifted_month < 10 {
            shifted_month + 3
        } else {
            shifted_month - 9
        };
        CivilTime {
            year: year_of_era + era * 400 + u64::from(month <= 2),
            month,
            day: day_of_year - (153 * shifted_month + 2) / 5 + 1,
            // 1970-01-01 was a Thursday.
            weekday: (days + 4) % 7,
            hour: of_day / 3_600,
            minute: of_day / 60 % 60,
            second: of_day % 60,
        }
    }
}

/// The last two decimal digits of `n`.
pub(crate) fn two_digits(n: u64) -> [u8; 2] {
    [b'0' + (n / 10 % 10) as u8, b'0' + (n % 10) as u8]
}
